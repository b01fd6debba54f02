"""The cluster-wide actors' per-request calls: what one costs, and how many per second each actor takes.

Usage: python bench/control_plane.py [--seconds 4] [--callers 64] [--bus-messages 20000] [--out docs/bench]

docs/scaling.md turns these numbers into the cluster size at which each one-of-a-kind component saturates, so they
are measured on the real actors, started by the project's own ``start_controller`` on a local Ray (embedded tiny
model, sandbox off: the launcher does the same work either way, and the bench should not measure bubblewrap). Each
row is one request's worth of calls, as the component that makes them does:

* launcher, OpenAI request: one ``report`` carrying its start and its ending (the ingress replica runs the instance
  itself on an admission slot of its lease, and reports what one event-loop turn began and ended as one message:
  ingress/slot_lease.py; a request whose user has no free slot there adds a ``lease`` call);
* launcher, uploaded program: ``launch`` + ``locate(wait)`` of a trivial program; the host runs it and reports its
  ending to the launcher with ``ended`` (batched per host loop turn), so the host's work is in this row too;
* market: ``join_many`` + ``leave_many`` (once per instance, from where it runs; those of one event-loop turn go
  as one call: wallet_calls.py);
* directory: ``register`` (a stored turn's snapshot, with a lineage of ``--lineage`` tokens) + ``lookup`` + ``remove``;
* response store: ``get`` (the previous turn) + ``put`` twice (in progress, finished), as a stored Responses turn;
* the floor: two calls of an empty async actor method, what the driver and Ray cost without any actor's work;
* one bus shard: messages/s, through bench/bus.py's own exchanges on a shard of its own.

"1 caller" is the median of sequential round trips from this driver; "N callers" runs N async callers for
``--seconds`` and counts completed requests. This driver submits every call, so on a small machine it shares the
cores with the actor it measures: the saturation rates are lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

import ray
from bus import TRUST, bus_rows
from pie_cluster.bus import start_bus
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SandboxConfig
from pie_cluster.control.controller import LAUNCHER
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.hosts.events import Ending
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.instance import Launch
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.launcher.records import RunnerReport
from pie_cluster.market.actor import MARKET_NAME
from pie_cluster.programs import BUILTINS, OPENAI_PROGRAM
from pie_cluster.programs.program import Program
from pie_cluster.ray_session import init_ray
from pie_cluster.stores.directory import DIRECTORY
from pie_cluster.stores.responses import RESPONSES, ResponseRecord
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

NOOP = b"async def main(input: dict) -> str:\n    return 'ok'\n"


@ray.remote(num_cpus=0)
class FakeRunner:
    """Stands for an ingress replica: the launcher only pings the runner that admits instances. Its empty method is
    the floor: what two Ray calls cost this driver with no work behind them."""

    async def nothing(self) -> None:
        return None


class Components:
    """One request's worth of calls to each cluster-wide actor, as an async function of a caller index."""

    def __init__(self, node: str, lineage: int):
        self.launcher = ray.get_actor(LAUNCHER)
        self.market = ray.get_actor(MARKET_NAME)
        self.directory = ray.get_actor(DIRECTORY)
        self.store = ray.get_actor(RESPONSES)
        self.runner = FakeRunner.remote()
        self.runner_name = uuid.uuid4().hex
        self.node = node
        self.wallets = wallet_calls(self.market)
        self.text = [(1000 + i % 7000, i) for i in range(lineage)]
        self.program = ray.get(self.launcher.upload.remote("bench", "noop.py", NOOP)).program
        self.openai_program = Program.from_path(BUILTINS[OPENAI_PROGRAM]).id  # what an ingress replica reports

    async def floor(self, k: int) -> None:
        await self.runner.nothing.remote()
        await self.runner.nothing.remote()

    async def openai(self, k: int) -> None:
        launch = Launch(uuid.uuid4().hex, f"u{k}", self.openai_program, {})
        ending = Ending(launch.id, "return", "")
        await self.launcher.report.remote(RunnerReport(self.runner_name, self.node, self.runner, (launch,), (ending,)))

    async def uploaded(self, k: int) -> None:
        instance = await self.launcher.launch.remote("bench", LaunchRequest(program=self.program))
        located = await self.launcher.locate.remote("bench", instance, 30.0)
        assert located.host is not None or located.ending is not None, located

    async def market_call(self, k: int) -> None:
        process = uuid.uuid4().hex
        await self.wallets.join(process, None)
        await self.wallets.leave(process)

    async def directory_call(self, k: int) -> None:
        name = uuid.uuid4().hex
        assert await self.directory.register.remote("m", f"u{k}", name, None, self.text, len(self.text))
        await self.directory.lookup.remote("m", f"u{k}", name)
        await self.directory.remove.remote("m", f"u{k}", name, None)

    async def store_call(self, k: int) -> None:
        user, rid = f"u{k}", f"resp_{uuid.uuid4().hex}"
        previous = await self.store.get.remote(user, rid)  # a miss costs the actor what a hit does
        items = [{"type": "message", "role": "user", "content": "hello " * 20}]
        record = ResponseRecord(rid, user, "m", {}, None, "header", items, "instance")
        await self.store.put.remote(record)
        record.body = {"status": "completed", "output": [{"type": "message", "content": "answer " * 40}]}
        record.instance = None if previous is None else previous.instance
        await self.store.put.remote(record)


async def latency(call, n: int) -> float:
    """Median ms of one request (sequential), after a few warm-ups."""
    for k in range(5):
        await call(k)
    times = []
    for k in range(n):
        start = time.perf_counter()
        await call(k)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


async def saturation(call, callers: int, seconds: float) -> float:
    """Requests/s with ``callers`` async callers, each running ``call`` back to back for ``seconds``."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call(k)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return done / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="how long each saturation run lasts")
    ap.add_argument("--callers", type=int, default=64, help="concurrent async callers in the saturation runs")
    ap.add_argument("--samples", type=int, default=200, help="sequential requests for the median latency")
    ap.add_argument("--lineage", type=int, default=512, help="tokens in a registered snapshot's lineage")
    ap.add_argument("--bus-messages", type=int, default=20_000)
    add_out_option(ap)
    args = ap.parse_args()
    console = Console(width=120)

    init_ray(num_cpus=4)
    config = PieConfig(
        auth=AuthConfig(enabled=False),
        model=[ModelConfigEntry(pages=256, cpus_per_rank=1)],
        sandbox=SandboxConfig(mode="off"),
    )
    controller = start_controller(config, detached=False)
    try:
        node = ray.get(controller.nodes.remote())[0]
        parts = Components(node, args.lineage)
        rows = [
            ("Ray floor", "an empty async actor method, twice", 2, parts.floor),
            ("launcher", "OpenAI request: report (its start and its end)", 1, parts.openai),
            ("launcher (+ host)", "uploaded program: launch + locate (+ host's ended)", 3, parts.uploaded),
            ("market", "instance: join_many + leave_many", 2, parts.market_call),
            ("directory", f"stored turn: register ({args.lineage} tokens) + lookup + remove", 3, parts.directory_call),
            ("response store", "stored turn: get + put + put", 3, parts.store_call),
        ]
        results = []
        for component, what, calls, call in rows:
            ms = asyncio.run(latency(call, args.samples))
            rate = asyncio.run(saturation(call, args.callers, args.seconds))
            results.append((component, what, calls, ms, rate))
            console.log(f"{component}: {ms:.2f} ms, {rate:,.0f} requests/s")
        launcher_stats = ray.get(parts.launcher.stats.remote())
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)

    bus = start_bus(1, name="pie-bus-bench", detached=False, secret=TRUST.secret)
    try:
        bus_result = bus_rows(bus, args.bus_messages, 1000, remote=False, run=0)
    finally:
        bus.shutdown()
    ray.shutdown()

    load = os.getloadavg()
    table = Table(title=f"cluster-wide actors: one request's calls, 1 caller and {args.callers} async callers")
    for col, justify in [
        ("component", "left"),
        ("per request", "left"),
        ("calls", "right"),
        ("1 caller, median ms", "right"),
        (f"{args.callers} callers, requests/s", "right"),
        ("calls/s asked", "right"),
    ]:
        table.add_column(col, justify=justify)
    for component, what, calls, ms, rate in results:
        table.add_row(component, what, str(calls), f"{ms:.2f}", f"{rate:,.0f}", f"{rate * calls:,.0f}")
    table.add_row(
        "bus shard (1 of N)",
        f"push -> pull, {64} pulls in flight; ping-pong round trip",
        "-",
        f"{bus_result['rtt'] / 1e3:.2f}",
        f"{bus_result['rate']:,.0f} msgs/s",
        f"{bus_result['fan']:,.0f} broadcast deliveries/s",
    )
    console.print(table)
    notes = [
        f"Load average while it ran (1, 5, 15 min): {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; the driver, "
        "Ray and the measured actor share these cores, so the requests/s are lower bounds.",
        f"Launcher's call counts at the end: {launcher_stats.calls}. 'Calls/s asked' is requests/s times the "
        "calls per request; the launcher's admissions and the market's wallets of one event-loop turn of a caller "
        "go as one call, so under many callers those actors take fewer calls than that (the counts above).",
        "The bus row: messages/s for push -> pull within one shard, median ping-pong round trip (ms), and "
        "broadcast deliveries/s (1 -> 8 subscribers); a shard is not a Ray call per message (bench/bus.py).",
    ]
    for note in notes:
        console.print(note)
    write_markdown(args.out, "control_plane", [table, *notes])


if __name__ == "__main__":
    main()
