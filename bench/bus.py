"""The message bus: messages/s and round-trip latency between inferlets, against ray.util.queue.Queue.

Usage: python bench/bus.py [--messages 50000] [--rounds 2000] [--shards 2] [--out docs/bench]

(a) push -> pull throughput: one inferlet pushes N messages while another pulls them with 64 pulls in flight (and
    with one: each pull is then a round trip to the shard, since a pull cannot prefetch without breaking exactly-once);
(b) broadcast fan-out: one inferlet broadcasts N/8 messages to 8 subscribed inferlets (deliveries/s);
(c) round-trip latency: two inferlets play ping-pong over push/pull (one round = two bus messages).
Each runs with both inferlets in this process, and with the second one in a Ray actor (another process, same node,
as when inferlets run in pooled host actors). The baseline is ray.util.queue.Queue (one actor, a Ray call per
put/get) doing the same exchange. The table also goes to ``OUT/bus.md`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray
from inferlet import messaging
from pie_cluster.bus import start_bus
from pie_cluster.hosts.in_process import LocalTrust
from pie_cluster.hosts.run import run_inferlet
from pie_cluster.ray_session import init_ray
from ray.util.queue import Queue
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

TRUST = LocalTrust()  # this process is the trusted side: its replica and bus verify what it mints
PULLS_IN_FLIGHT = 64
SUBSCRIBERS = 8


async def producer(input: dict) -> None:
    """Push ``n`` messages on "items", letting the loop run every 256 so frames go out while we produce."""
    messaging.push("ready", "")
    await messaging.pull("start")
    for i in range(input["n"]):
        messaging.push("items", str(i))
        if i % 256 == 255:
            await asyncio.sleep(0)


async def consumer(input: dict) -> float:
    """Pull ``n`` messages with ``in_flight`` pulls outstanding; messages/s from start to the last message."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await messaging.pull("items")

    await messaging.pull("ready")  # the producer may be a Ray actor that is still starting
    start = time.perf_counter()
    messaging.push("start", "")
    await asyncio.gather(*(worker(input["n"] // input["in_flight"]) for _ in range(input["in_flight"])))
    return input["n"] / (time.perf_counter() - start)


async def publisher(input: dict) -> float:
    """Wait for every subscriber, broadcast ``n`` messages and an end marker; deliveries/s until all confirm."""
    for _ in range(input["subscribers"]):
        await messaging.pull("joined")
    start = time.perf_counter()
    for i in range(input["n"]):
        messaging.broadcast("news", str(i))
        if i % 256 == 255:
            await asyncio.sleep(0)
    messaging.broadcast("news", "end")
    for _ in range(input["subscribers"]):
        await messaging.pull("finished")
    return input["n"] * input["subscribers"] / (time.perf_counter() - start)


async def subscriber(input: dict) -> int:
    sub = messaging.subscribe("news")
    messaging.push("joined", "")
    got = 0
    async for message in sub:
        if message == "end":
            break
        got += 1
    messaging.push("finished", "")
    return got + sub.dropped


async def ping(input: dict) -> list[float]:
    """Round-trip times in µs, after a warm-up."""
    times = []
    for i in range(input["rounds"] + 100):
        start = time.perf_counter()
        messaging.push("ping", str(i))
        await messaging.pull("pong")
        times.append((time.perf_counter() - start) * 1e6)
    return times[100:]


async def pong(input: dict) -> None:
    for _ in range(input["rounds"] + 100):
        messaging.push("pong", await messaging.pull("ping"))


@ray.remote(num_cpus=0)
class Peer:
    """An inferlet host in another process: runs one inferlet on its own event loop."""

    async def run(self, main, input: dict, user: str, identity: dict, bus) -> object:
        return await run_inferlet(main, input, {}, user, **identity, bus=bus.addresses())


async def pair(bus, first, first_input, second, second_input, user: str, remote: bool, copies: int = 1):
    """Run ``first`` here and ``copies`` of ``second`` here or in Ray actors; returns ``first``'s result."""
    if remote:
        peers = [Peer.remote() for _ in range(copies)]
        others = [
            asyncio.wrap_future(p.run.remote(second, second_input, user, TRUST.instance(user), bus).future())
            for p in peers
        ]
    else:
        others = [
            run_inferlet(second, second_input, {}, user, **TRUST.instance(user), bus=bus.addresses())
            for _ in range(copies)
        ]
    first_run = run_inferlet(first, first_input, {}, user, **TRUST.instance(user), bus=bus.addresses())
    results = await asyncio.gather(first_run, *others)
    if remote:
        for p in peers:
            ray.kill(p)
    return results[0], results[1:]


def bus_rows(bus, n: int, rounds: int, remote: bool, run: int) -> dict[str, float]:
    where = "ray-actor" if remote else "local"
    n = n // PULLS_IN_FLIGHT * PULLS_IN_FLIGHT
    rate, _ = asyncio.run(
        pair(bus, consumer, {"n": n, "in_flight": PULLS_IN_FLIGHT}, producer, {"n": n}, f"tp-{where}-{run}", remote)
    )
    one = n // 10
    rate_one, _ = asyncio.run(
        pair(bus, consumer, {"n": one, "in_flight": 1}, producer, {"n": one}, f"tp1-{where}-{run}", remote)
    )
    fan, counts = asyncio.run(
        pair(
            bus,
            publisher,
            {"n": n // SUBSCRIBERS, "subscribers": SUBSCRIBERS},
            subscriber,
            {},
            f"fan-{where}-{run}",
            remote,
            copies=SUBSCRIBERS,
        )
    )
    assert all(c == n // SUBSCRIBERS for c in counts), counts
    times, _ = asyncio.run(pair(bus, ping, {"rounds": rounds}, pong, {"rounds": rounds}, f"rt-{where}-{run}", remote))
    rtt, p99 = statistics.median(times), statistics.quantiles(times, n=100)[98]
    return {"rate": rate, "rate_one": rate_one, "fan": fan, "rtt": rtt, "p99": p99}


@ray.remote(num_cpus=0)
def queue_pong(items: Queue, replies: Queue, rounds: int) -> None:
    for _ in range(rounds):
        replies.put(items.get())


def ray_queue_rows(n: int, rounds: int) -> dict[str, float]:
    """The same exchanges through ray.util.queue.Queue: throughput from this process (puts then gets, one at a
    time and PULLS_IN_FLIGHT at a time), ping-pong against a Ray task."""
    items, replies = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
    start = time.perf_counter()
    for i in range(n):
        items.put(str(i))
    for _ in range(n):
        items.get()
    rate_one = n / (time.perf_counter() - start)

    async def many() -> float:
        async def worker(count: int) -> None:
            for _ in range(count):
                await items.get_async()

        begin = time.perf_counter()
        consumers = asyncio.gather(*(worker(n // PULLS_IN_FLIGHT) for _ in range(PULLS_IN_FLIGHT)))
        for i in range(0, n, PULLS_IN_FLIGHT):
            await asyncio.gather(*(items.put_async(str(k)) for k in range(i, i + PULLS_IN_FLIGHT)))
        await consumers
        return n / (time.perf_counter() - begin)

    rate = asyncio.run(many())
    done = queue_pong.remote(items, replies, rounds)
    times = []
    for i in range(rounds):
        t = time.perf_counter()
        items.put(str(i))
        replies.get()
        times.append((time.perf_counter() - t) * 1e6)
    ray.get(done)
    for q in (items, replies):
        q.shutdown()
    rtt, p99 = statistics.median(times), statistics.quantiles(times, n=100)[98]
    return {"rate": rate, "rate_one": rate_one, "rtt": rtt, "p99": p99}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-messages", type=int, default=2000)
    add_out_option(ap)
    args = ap.parse_args()

    init_ray(num_cpus=4)
    bus = start_bus(args.shards, name="pie-bus-bench", detached=False, secret=TRUST.secret)
    results = {}
    for remote in (False, True):
        runs = [bus_rows(bus, args.messages, args.rounds, remote, r) for r in range(args.repeats)]
        results[remote] = {key: (min if key in ("rtt", "p99") else max)(r[key] for r in runs) for key in runs[0]}
    leftover = bus.stats()
    bus.shutdown()
    base = ray_queue_rows(args.baseline_messages // PULLS_IN_FLIGHT * PULLS_IN_FLIGHT, args.baseline_messages // 4)

    console = Console(width=120)
    table = Table(title=f"message bus ({args.shards} shards) vs ray.util.queue.Queue, best of {args.repeats}")
    for col in ("", "bus, same process", "bus, other process", "ray Queue", "bus (other process) / Queue"):
        table.add_column(col, justify="right")
    local, remote = results[False], results[True]

    def row(label: str, key: str, higher_is_better: bool = True) -> None:
        fmt = "{:,.0f}".format
        if key not in base:
            table.add_row(label, fmt(local[key]), fmt(remote[key]), "-", "-")
            return
        ratio = remote[key] / base[key] if higher_is_better else base[key] / remote[key]
        table.add_row(label, fmt(local[key]), fmt(remote[key]), fmt(base[key]), f"{ratio:,.1f}x better")

    row(f"push -> pull, msgs/s ({PULLS_IN_FLIGHT} pulls in flight)", "rate")
    row("push -> pull, msgs/s (1 pull in flight)", "rate_one")
    row(f"broadcast deliveries/s (1 -> {SUBSCRIBERS})", "fan")
    row("ping-pong round trip, median µs", "rtt", higher_is_better=False)
    row("ping-pong round trip, p99 µs", "p99", higher_is_better=False)
    console.print(table)
    console.print(f"left on the bus afterwards: {leftover}")
    write_markdown(args.out, "bus", [table, f"left on the bus afterwards: {leftover}"])


if __name__ == "__main__":
    main()
