"""The cluster: launch latency, message-bus throughput and round trip within and across nodes, memory per idle
inferlet.

One two-node cluster set-up serves all of its measurements, which is why they stay in one file past 400 lines.

Usage: python bench/cluster.py [--launches 40] [--isolated-launches 8] [--messages 50000] [--rounds 2000]
                               [--repeats 3] [--idle 200] [--out docs/bench]

Brings up a two-node Ray cluster on this machine (two raylets, 4 CPUs each), a Pie cluster on it (one replica of the
embedded tiny model, the bus with 2 shards, a pooled inferlet host per node, the launcher) and the HTTP endpoint on
Ray Serve, then measures:

(a) memory per idle pooled inferlet: K instances pinned to one node, each parked in ``await session.receive()``
    (it has sent its pid first, so we know it got there); RSS of that node's pooled host process before and after,
    over K. Then every one is aborted and must end.
(b) launch latency: from just before the HTTP launch until the instance's first event arrives, for
    ``async def main(input): return "ok"``, N sequential launches, pooled (an asyncio task in the node's host) vs
    isolated (a dedicated host process per instance); the program is uploaded once, before timing. Over HTTP in one
    request (POST /v1/instances?stream=true answers with the SSE stream) and in two (POST, then GET .../events).
    Interleaved with each, the same launch through the launcher actor directly (a Ray call, then a long-poll for the
    first event): the difference is what HTTP and Serve add.
(c) the bus, measured inside two inferlets launched on the cluster: push -> pull messages/s (64 pulls in flight, and
    one at a time) and ping-pong round trip (one round = two messages), with the pair on the same node (in its one
    pooled host; and in two isolated hosts, i.e. two processes) and across nodes (one in each node's pooled host).
    The topics are picked to live on a bus shard of the first inferlet's node, so same-node traffic never leaves it.

Goals (issue 6): launch < 20 ms pooled (median); >= 20k bus messages/s; < 2 MiB per idle pooled inferlet.
The tables also go to ``OUT/cluster.md`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import statistics
import tempfile
import textwrap
import time
import zipfile
import zlib
from pathlib import Path

import psutil
import ray
from local_pie import wait_healthy
from pie_cluster.bus import find_bus
from pie_cluster.client import PieClient
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig
from pie_cluster.controller import LAUNCHER, start_controller
from pie_cluster.events import TERMINAL, follow
from pie_cluster.http_app import serve_http, stop_http
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.local_ray import NAMESPACE
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table
from vllm_peer import free_port

GOAL_LAUNCH_MS = 20.0
GOAL_BUS_RATE = 20_000
GOAL_IDLE_MIB = 2.0
PULLS_IN_FLIGHT = 64
WARMUP_ROUNDS = 100
DEADLINE_S = 300.0
USER = "bench"

TRIVIAL = 'async def main(input):\n    return "ok"\n'

IDLE = """
import os
from inferlet import session

async def main(input):
    session.send(str(os.getpid()))
    return await session.receive()
"""

BUS = """
import asyncio
import os
import statistics
import time
from inferlet import messaging


async def producer(topics, n):
    messaging.push(topics["ready"], "")
    await messaging.pull(topics["start"])
    for i in range(n):
        messaging.push(topics["items"], str(i))
        if i % 256 == 255:
            await asyncio.sleep(0)
    return n


async def consumer(topics, n, in_flight):
    async def worker(count):
        for _ in range(count):
            await messaging.pull(topics["items"])

    await messaging.pull(topics["ready"])  # the producer may still be starting (another host, another process)
    start = time.perf_counter()
    messaging.push(topics["start"], "")
    await asyncio.gather(*(worker(n // in_flight) for _ in range(in_flight)))
    return n / (time.perf_counter() - start)


async def ping(topics, rounds, warmup):
    times = []
    for i in range(rounds + warmup):
        start = time.perf_counter()
        messaging.push(topics["ping"], str(i))
        await messaging.pull(topics["pong"])
        times.append((time.perf_counter() - start) * 1e6)
    times = times[warmup:]
    return {"median": statistics.median(times), "p99": statistics.quantiles(times, n=100)[98]}


async def pong(topics, rounds, warmup):
    for _ in range(rounds + warmup):
        messaging.push(topics["pong"], await messaging.pull(topics["ping"]))


async def main(input):
    role = input.pop("role")
    value = await {"producer": producer, "consumer": consumer, "ping": ping, "pong": pong}[role](**input)
    return {"pid": os.getpid(), "value": value}
"""

BUS_TOPICS = ("ready", "start", "items", "ping", "pong")


def isolated_zip(name: str, source: str) -> bytes:
    """A directory program (pie.toml + main.py) with ``isolated = true``, zipped as the client uploads it."""
    manifest = f'[package]\nname = "{name}"\nversion = "0.1.0"\n[inferlet]\nentry = "main.py"\nisolated = true\n'
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("pie.toml", manifest)
        archive.writestr("main.py", textwrap.dedent(source))
    return buf.getvalue()


def upload(launcher, source: str, isolated: bool = False, name: str = "prog") -> str:
    if isolated:
        return ray.get(launcher.upload.remote(USER, f"{name}.zip", isolated_zip(name, source)))["program"]
    return ray.get(launcher.upload.remote(USER, f"{name}.py", textwrap.dedent(source).encode()))["program"]


def run_to_end(launcher, user: str, instance_id: str, timeout: float = DEADLINE_S) -> tuple[str, str]:
    """Follow the instance's events to its terminal one: (kind, value)."""

    async def terminal() -> tuple[str, str]:
        async for events in follow(launcher, user, instance_id, wait=10.0):
            for _, kind, value in events:
                if kind in TERMINAL:
                    return kind, value
        raise RuntimeError(f"instance {instance_id} ended without a terminal event")

    try:
        return asyncio.run(asyncio.wait_for(terminal(), timeout))
    except TimeoutError:
        raise TimeoutError(f"instance {instance_id} did not end within {timeout:g} s") from None


def returned(launcher, user: str, instance_id: str):
    kind, value = run_to_end(launcher, user, instance_id)
    if kind != "return":
        raise RuntimeError(f"instance {instance_id} failed: {value}")
    return json.loads(value)


def quantile(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method), e.g. q=90."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


# -- (a) memory per idle pooled inferlet -------------------------------------------------------------------------


def wait_for_message(launcher, ids: list[str], timeout: float = DEADLINE_S) -> dict[str, str]:
    """The first ``message`` event of each instance (each idle inferlet sends its pid before it parks)."""
    got: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids) - len(got)} idle inferlets never reached session.receive()")
        waiting = [i for i in ids if i not in got]
        batches = ray.get([launcher.events.remote(USER, i, 0, 10.0) for i in waiting])
        for instance_id, batch in zip(waiting, batches, strict=True):
            for _, kind, value in batch["events"]:
                if kind == "message":
                    got[instance_id] = value
                    break
                if kind in ("return", "error"):
                    raise RuntimeError(f"idle instance {instance_id} ended: {kind} {value}")
    return got


def rss(pid: int) -> tuple[int, int]:
    """(RSS, USS) of a process in bytes; sampled a few times, the median, since the host's heap breathes."""
    process = psutil.Process(pid)
    samples = []
    for _ in range(5):
        info = process.memory_full_info()
        samples.append((info.rss, info.uss))
        time.sleep(0.1)
    return int(statistics.median(s[0] for s in samples)), int(statistics.median(s[1] for s in samples))


def idle_memory(launcher, node: str, k: int, console: Console) -> dict:
    program = upload(launcher, IDLE, name="idle")
    # warm-up: the first instance on a host imports the session machinery; keep that out of the per-instance cost
    request = LaunchRequest(program=program, deadline_s=DEADLINE_S, node_id=node)
    warm = ray.get(launcher.launch.remote(USER, request))
    pid = int(wait_for_message(launcher, [warm])[warm])
    ray.get(launcher.abort.remote(USER, warm))
    run_to_end(launcher, USER, warm)
    time.sleep(0.5)
    running_before = ray.get(launcher.stats.remote())["running"]
    before = rss(pid)

    ids = ray.get([launcher.launch.remote(USER, request) for _ in range(k)])
    pids = wait_for_message(launcher, ids)
    if {int(p) for p in pids.values()} != {pid}:
        raise RuntimeError(f"idle inferlets ran in processes {set(pids.values())}, not the pooled host {pid}")
    time.sleep(0.5)
    after = rss(pid)
    console.log(f"(a) {k} idle inferlets parked in pooled host pid {pid}; aborting them")

    aborted = ray.get([launcher.abort.remote(USER, i) for i in ids])
    ends = [run_to_end(launcher, USER, i) for i in ids]
    ended_by_abort = sum(1 for kind, value in ends if kind == "error" and "aborted" in value)
    time.sleep(0.5)
    released = rss(pid)
    running_after = ray.get(launcher.stats.remote())["running"]
    return {
        "k": k,
        "pid": pid,
        "before": before,
        "after": after,
        "released": released,
        "aborted": sum(aborted),
        "ended": ended_by_abort,
        "running_before": running_before,
        "running_after": running_after,
    }


# -- (b) launch latency ------------------------------------------------------------------------------------------


def http_launch_ms(client: PieClient, program: str) -> float:
    """HTTP POST /v1/instances -> first SSE event, in ms; follows the stream to its end (the instance is done)."""
    start = time.perf_counter()
    instance_id = client.launch(LaunchRequest(program=program))
    first, last = None, None
    for _, kind, value in client.events(instance_id):
        if first is None:
            first = time.perf_counter()
        last = (kind, value)
    if last != ("return", "ok"):
        raise RuntimeError(f"trivial instance {instance_id} ended with {last}")
    return (first - start) * 1e3


def streamed_launch_ms(client: PieClient, program: str) -> float:
    """HTTP POST /v1/instances?stream=true -> the first event after ``launched``, in ms; follows it to the end."""
    start = time.perf_counter()
    first, last = None, None
    for _, kind, value in client.launch_and_follow(LaunchRequest(program=program)):
        if first is None and kind != "launched":
            first = time.perf_counter()
        last = (kind, value)
    if last != ("return", "ok"):
        raise RuntimeError(f"a trivial instance ended with {last}")
    return (first - start) * 1e3


def direct_launch_ms(launcher, program: str) -> float:
    """launcher.launch (a Ray call) -> first event from launcher.events (a long poll), in ms."""
    start = time.perf_counter()
    instance_id = ray.get(launcher.launch.remote(USER, LaunchRequest(program=program, deadline_s=DEADLINE_S)))
    while not (got := ray.get(launcher.events.remote(USER, instance_id, 0, 30.0)))["events"]:
        pass
    first = time.perf_counter()
    if run_to_end(launcher, USER, instance_id) != ("return", "ok"):
        raise RuntimeError(f"trivial instance {instance_id} ended with {got}")
    return (first - start) * 1e3


def launch_latency(client: PieClient, launcher, tmp: Path, n: tuple[int, int], warmup: int) -> dict[str, list[float]]:
    pooled_file = tmp / "trivial.py"
    pooled_file.write_text(TRIVIAL)
    isolated_dir = tmp / "trivial-isolated"
    isolated_dir.mkdir()
    (isolated_dir / "main.py").write_text(TRIVIAL)
    (isolated_dir / "pie.toml").write_text(
        '[package]\nname = "trivial-isolated"\nversion = "0.1.0"\n[inferlet]\nentry = "main.py"\nisolated = true\n'
    )
    pooled = client.upload(pooled_file)["program"]
    uploaded = client.upload(isolated_dir)
    assert uploaded["isolated"], uploaded
    isolated = uploaded["program"]
    out: dict[str, list[float]] = {}
    for name, program, count in (("pooled", pooled, n[0]), ("isolated", isolated, n[1])):
        for _ in range(warmup):
            streamed_launch_ms(client, program)
            http_launch_ms(client, program)
            direct_launch_ms(launcher, program)
        streamed, http, direct = [], [], []
        for _ in range(count):
            streamed.append(streamed_launch_ms(client, program))
            http.append(http_launch_ms(client, program))
            direct.append(direct_launch_ms(launcher, program))
        out[name], out[f"{name}-2req"], out[f"{name}-direct"] = streamed, http, direct
    return out


# -- (c) the bus -------------------------------------------------------------------------------------------------


def topics_on_shard(user: str, shard: int, shards: int) -> dict[str, str]:
    """A name for each topic of a pair that puts it on ``shard`` (a topic lives on crc32(user, topic) % shards).

    Each topic gets its own suffix: one suffix shared by all of them may never work, since CRC is affine and the
    low bits of two equal-length names that differ only in their prefix differ by a constant."""

    def name(topic: str) -> str:
        for i in range(10_000):
            candidate = f"{topic}-{i}"
            if zlib.crc32(f"{user}\0{candidate}".encode()) % shards == shard:
                return candidate
        raise RuntimeError(f"no name for topic {topic!r} of {user!r} lands on shard {shard} of {shards}")

    return {topic: name(topic) for topic in BUS_TOPICS}


def pair_request(program: str, input: dict, node: str) -> LaunchRequest:
    return LaunchRequest(program=program, input=input, deadline_s=DEADLINE_S, node_id=node)


def bus_pair(launcher, program: str, user: str, topics: dict, nodes: tuple[str, str], first: dict, second: dict):
    """Launch ``first`` on nodes[0] and ``second`` on nodes[1]; both results ({"pid", "value"})."""
    ids = ray.get(
        [
            launcher.launch.remote(user, pair_request(program, {**first, "topics": topics}, nodes[0])),
            launcher.launch.remote(user, pair_request(program, {**second, "topics": topics}, nodes[1])),
        ]
    )
    return [returned(launcher, user, i) for i in ids]


def bus_run(launcher, program: str, nodes, shard: int, shards: int, messages: int, rounds: int, label: str, run: int):
    n = max(messages // PULLS_IN_FLIGHT, 1) * PULLS_IN_FLIGHT
    one = max(n // 10, 1)
    out, pids = {}, set()
    for key, count, in_flight in (("rate", n, PULLS_IN_FLIGHT), ("rate_one", one, 1)):
        user = f"bus-{label}-{key}-{run}"
        consumer, producer = bus_pair(
            launcher,
            program,
            user,
            topics_on_shard(user, shard, shards),
            nodes,
            {"role": "consumer", "n": count, "in_flight": in_flight},
            {"role": "producer", "n": count},
        )
        out[key] = consumer["value"]
        pids.add((consumer["pid"], producer["pid"]))
    user = f"bus-{label}-rtt-{run}"
    ping, pong = bus_pair(
        launcher,
        program,
        user,
        topics_on_shard(user, shard, shards),
        nodes,
        {"role": "ping", "rounds": rounds, "warmup": WARMUP_ROUNDS},
        {"role": "pong", "rounds": rounds, "warmup": WARMUP_ROUNDS},
    )
    out["rtt"], out["p99"] = ping["value"]["median"], ping["value"]["p99"]
    pids.add((ping["pid"], pong["pid"]))
    out["same_process"] = all(a == b for a, b in pids)
    return out


def bus_bench(launcher, nodes: list[str], args, console: Console) -> tuple[dict, str]:
    bus = find_bus()
    shards = len(bus.infos)
    shard = 0
    home = bus.infos[shard].node_id
    other = next((n for n in nodes if n != home), None)
    pooled, isolated = upload(launcher, BUS, name="bus"), upload(launcher, BUS, isolated=True, name="bus-isolated")
    configs = [
        ("same node, 1 pooled host", pooled, (home, home), True),
        ("same node, 2 isolated hosts", isolated, (home, home), False),
    ]
    if other is not None:
        configs.append(("cross-node, 2 pooled hosts", pooled, (home, other), False))
    results = {}
    for index, (label, program, where, same_process) in enumerate(configs):
        console.log(f"(c) bus: {label}")
        runs = [
            bus_run(launcher, program, where, shard, shards, args.messages, args.rounds, f"c{index}", r)
            for r in range(args.repeats)
        ]
        if any(r["same_process"] != same_process for r in runs):
            raise RuntimeError(f"{label}: the pair did not run in the expected processes")
        results[label] = {k: (min if k in ("rtt", "p99") else max)(r[k] for r in runs) for k in runs[0]}
    placement = f"{shards} shards; the topics on shard {shard} (node {home[:8]})"
    return results, placement


# -- the cluster -------------------------------------------------------------------------------------------------


def mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


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

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    from ray.cluster_utils import Cluster

    console = Console(width=120)
    load = os.getloadavg()
    began = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    cluster.add_node(num_cpus=4)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    controller = client = None
    tmp = tempfile.TemporaryDirectory(prefix="pie-bench-cluster-")
    try:
        config = PieConfig(auth=AuthConfig(enabled=False), model=[ModelConfigEntry(pages=256, cpus_per_rank=1)])
        controller = start_controller(config, detached=False)
        url = serve_http(config.auth, NAMESPACE, config.server.model_copy(update={"port": free_port()}))
        wait_healthy(url)
        launcher = ray.get_actor(LAUNCHER)
        nodes = ray.get(controller.nodes.remote())
        client = PieClient(url)
        console.log(f"cluster up: {len(nodes)} nodes, HTTP at {url} ({time.perf_counter() - began:.0f} s)")

        memory = idle_memory(launcher, nodes[-1], args.idle, console)
        console.log("(b) launch latency")
        latency = launch_latency(
            client, launcher, Path(tmp.name), (args.launches, args.isolated_launches), args.launch_warmup
        )
        bus, placement = bus_bench(launcher, nodes, args, console)
    finally:
        if client is not None:
            client.close()
        if controller is not None:
            try:
                stop_http()
            except Exception as e:  # a failed run should still tear the cluster down
                console.log(f"stopping Serve failed: {e}")
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
        ray.shutdown()
        cluster.shutdown()
        tmp.cleanup()

    mib = 1 << 20
    goals = []
    report = []  # what goes to OUT/cluster.md: the tables and notes printed below, in order

    def show(part) -> None:
        console.print(part)
        report.append(part)

    table = Table(title=f"(a) memory per idle pooled inferlet ({memory['k']} parked in session.receive(), one host)")
    for col in ("", "RSS", "USS"):
        table.add_column(col, justify="right")
    for label, key in (("host before", "before"), (f"host with {memory['k']} idle", "after")):
        table.add_row(label, f"{memory[key][0] / mib:,.1f} MiB", f"{memory[key][1] / mib:,.1f} MiB")
    per = [(memory["after"][i] - memory["before"][i]) / memory["k"] for i in (0, 1)]
    table.add_row("per idle inferlet", f"{per[0] / 1024:,.0f} KiB", f"{per[1] / 1024:,.0f} KiB")
    table.add_row("host after aborting them", *(f"{memory['released'][i] / mib:,.1f} MiB" for i in (0, 1)))
    show(table)
    ok = memory["ended"] == memory["k"] and memory["running_after"] == memory["running_before"]
    show(
        f"aborted {memory['aborted']}/{memory['k']}, ended with 'aborted' {memory['ended']}/{memory['k']}; "
        f"launcher's running count {memory['running_before']} before, {memory['running_after']} after "
        f"({'all cleaned up' if ok else '[red]NOT all cleaned up[/red]'})"
    )
    goals.append(
        (
            "memory per idle pooled inferlet (RSS)",
            f"{per[0] / mib:.2f} MiB",
            f"< {GOAL_IDLE_MIB:g} MiB",
            per[0] / mib < GOAL_IDLE_MIB,
        )
    )

    table = Table(title='(b) launch latency, ms: HTTP launch -> first event of `return "ok"`, sequential launches')
    for col in ("", "launches", "median", "p90", "min", "two requests: median", "launcher actor: median"):
        table.add_column(col, justify="right")
    for name in ("pooled", "isolated"):
        streamed = latency[name]
        table.add_row(
            name,
            str(len(streamed)),
            f"{statistics.median(streamed):,.1f}",
            f"{quantile(streamed, 90):,.1f}",
            f"{min(streamed):,.1f}",
            f"{statistics.median(latency[f'{name}-2req']):,.1f}",
            f"{statistics.median(latency[f'{name}-direct']):,.1f}",
        )
    show(table)
    pooled_median = statistics.median(latency["pooled"])
    goals.append(
        (
            "launch latency, pooled, HTTP (one request) median",
            f"{pooled_median:.1f} ms",
            f"< {GOAL_LAUNCH_MS:g} ms",
            pooled_median < GOAL_LAUNCH_MS,
        )
    )

    table = Table(title=f"(c) message bus between two inferlets, best of {args.repeats} ({placement})")
    table.add_column("", no_wrap=True)
    for label in bus:
        table.add_column(label, justify="right")
    fmt = "{:,.0f}".format
    table.add_row(f"push -> pull, msgs/s ({PULLS_IN_FLIGHT} pulls in flight)", *(fmt(r["rate"]) for r in bus.values()))
    table.add_row("push -> pull, msgs/s (1 pull in flight)", *(fmt(r["rate_one"]) for r in bus.values()))
    table.add_row("ping-pong round trip, median µs", *(fmt(r["rtt"]) for r in bus.values()))
    table.add_row("ping-pong round trip, p99 µs", *(fmt(r["p99"]) for r in bus.values()))
    show(table)
    for label, r in bus.items():
        goals.append((f"bus msgs/s, {label}", fmt(r["rate"]), f">= {GOAL_BUS_RATE:,}", r["rate"] >= GOAL_BUS_RATE))

    table = Table(title="goals (issue 6)")
    for col, justify in (("measurement", "left"), ("measured", "right"), ("goal", "right"), ("met", "center")):
        table.add_column(col, justify=justify)
    for name, value, goal, met in goals:
        table.add_row(name, value, goal, mark(met))
    show(table)
    show(
        f"load average at start {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores; "
        f"total {time.perf_counter() - began:.0f} s"
    )
    write_markdown(args.out, "cluster", report)


if __name__ == "__main__":
    main()
