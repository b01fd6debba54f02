"""The cluster: launch latency, message-bus throughput and round trip within and across nodes, memory per idle
inferlet.

Usage: python bench/cluster.py [--launches 40] [--isolated-launches 8] [--messages 50000] [--rounds 2000]
                               [--repeats 3] [--idle 200] [--out docs/bench]

Brings up a two-node Ray cluster on this machine (two raylets, 4 CPUs each), a Pie cluster on it (one replica of the
embedded tiny model, the bus with 2 shards, a pooled inferlet host per node, the launcher) and the HTTP endpoint on
Ray Serve (cluster_setup.py), then measures:

(a) memory per idle pooled inferlet: K instances parked in ``await session.receive()`` in one node's pooled host,
    its RSS before and after, over K; then every one is aborted and must end (cluster_memory.py).
(b) launch latency: HTTP launch -> first event of a trivial inferlet, pooled vs isolated, in one request and in two,
    and the same launch through the launcher actor directly (cluster_latency.py).
(c) the bus, inside two inferlets: push -> pull messages/s and ping-pong round trip, the pair in one pooled host,
    in two isolated hosts, and across nodes (cluster_bus.py).

Goals (issue 6): launch < 20 ms pooled (median); >= 20k bus messages/s; < 2 MiB per idle pooled inferlet.
The tables (cluster_report.py) also go to ``OUT/cluster.md`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import os
import time

from cluster_bus import bus_bench
from cluster_latency import launch_latency
from cluster_memory import idle_memory
from cluster_report import report
from cluster_setup import two_node_pie
from report import add_out_option, write_markdown
from rich.console import Console


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=40, help="timed pooled launches (HTTP and direct each)")
    ap.add_argument("--isolated-launches", type=int, default=8, help="timed isolated launches (HTTP and direct each)")
    ap.add_argument("--launch-warmup", type=int, default=2)
    ap.add_argument("--messages", type=int, default=50_000, help="push -> pull messages per run (1/10 with 1 pull)")
    ap.add_argument("--rounds", type=int, default=2000, help="ping-pong rounds per run")
    ap.add_argument("--repeats", type=int, default=3, help="bus runs per configuration (best is reported)")
    ap.add_argument("--idle", type=int, default=200, help="idle pooled inferlets for the memory measurement")
    add_out_option(ap)
    args = ap.parse_args()

    console = Console(width=120)
    load = os.getloadavg()
    began = time.perf_counter()
    with two_node_pie(console) as pie:
        memory = idle_memory(pie.launcher, pie.nodes[-1], args.idle, console)
        console.log("(b) launch latency")
        latency = launch_latency(
            pie.client, pie.launcher, pie.tmp, (args.launches, args.isolated_launches), args.launch_warmup
        )
        bus, placement = bus_bench(pie.launcher, pie.nodes, args.messages, args.rounds, args.repeats, console)

    parts = report(memory, latency, bus, placement, args.repeats)
    parts.append(
        f"load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores; "
        f"total {time.perf_counter() - began:.0f} s"
    )
    for part in parts:
        console.print(part)
    write_markdown(args.out, "cluster", parts)


if __name__ == "__main__":
    main()
