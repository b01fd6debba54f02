"""(c) of bench/cluster.py: the message bus, measured inside two inferlets launched on the cluster.

push -> pull messages/s (64 pulls in flight, and one at a time) and ping-pong round trip (one round = two
messages), with the pair on the same node (in its one pooled host; and in two isolated hosts, i.e. two processes)
and across nodes (one in each node's pooled host). The topics are picked to live on a bus shard of the first
inferlet's node, so same-node traffic never leaves it.
"""

from __future__ import annotations

import zlib

import ray
from cluster_inferlets import DEADLINE_S, returned, upload
from pie_cluster.bus import find_bus
from pie_cluster.launch_request import LaunchRequest
from rich.console import Console

PULLS_IN_FLIGHT = 64
WARMUP_ROUNDS = 100

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
    """The launch of one side of the pair, pinned to ``node``."""
    return LaunchRequest(program=program, input=input, deadline_s=DEADLINE_S, node_id=node)


def bus_pair(launcher, isolated: bool, user: str, topics: dict, nodes: tuple[str, str], first: dict, second: dict):
    """Launch ``first`` on nodes[0] and ``second`` on nodes[1] as ``user``; both results ({"pid", "value"}).
    Each pair has a user of its own, which owns the topics and so must upload the program too."""
    program = upload(launcher, BUS, isolated=isolated, name="bus-isolated" if isolated else "bus", user=user)
    ids = ray.get(
        [
            launcher.launch.remote(user, pair_request(program, {**first, "topics": topics}, nodes[0])),
            launcher.launch.remote(user, pair_request(program, {**second, "topics": topics}, nodes[1])),
        ]
    )
    return [returned(launcher, user, i) for i in ids]


def bus_run(launcher, isolated: bool, nodes, shard: int, shards: int, messages: int, rounds: int, label: str, run: int):
    """One run of each test for the pair on ``nodes``: the two rates, the round trip median and p99, and whether
    both ran in the same process."""
    n = max(messages // PULLS_IN_FLIGHT, 1) * PULLS_IN_FLIGHT
    one = max(n // 10, 1)
    tests = (  # key, what the first inferlet runs (it returns the measurement), what the second one runs
        ("rate", {"role": "consumer", "n": n, "in_flight": PULLS_IN_FLIGHT}, {"role": "producer", "n": n}),
        ("rate_one", {"role": "consumer", "n": one, "in_flight": 1}, {"role": "producer", "n": one}),
        (
            "rtt",
            {"role": "ping", "rounds": rounds, "warmup": WARMUP_ROUNDS},
            {"role": "pong", "rounds": rounds, "warmup": WARMUP_ROUNDS},
        ),
    )
    out, pids = {}, set()
    for key, first, second in tests:
        user = f"bus-{label}-{key}-{run}"
        measured, other = bus_pair(launcher, isolated, user, topics_on_shard(user, shard, shards), nodes, first, second)
        out[key] = measured["value"]
        pids.add((measured["pid"], other["pid"]))
    out["rtt"], out["p99"] = out["rtt"]["median"], out["rtt"]["p99"]
    out["same_process"] = all(a == b for a, b in pids)
    return out


def bus_bench(
    launcher, nodes: list[str], messages: int, rounds: int, repeats: int, console: Console
) -> tuple[dict, str]:
    """The best of ``repeats`` runs per placement of the pair, by label, and a line saying where the topics live."""
    bus = find_bus()
    shards = len(bus.infos)
    shard = 0
    home = bus.infos[shard].node_id
    other = next((n for n in nodes if n != home), None)
    configs = [
        ("same node, 1 pooled host", False, (home, home), True),
        ("same node, 2 isolated hosts", True, (home, home), False),
    ]
    if other is not None:
        configs.append(("cross-node, 2 pooled hosts", False, (home, other), False))
    results = {}
    for index, (label, isolated, where, same_process) in enumerate(configs):
        console.log(f"(c) bus: {label}")
        runs = [
            bus_run(launcher, isolated, where, shard, shards, messages, rounds, f"c{index}", r) for r in range(repeats)
        ]
        if any(r["same_process"] != same_process for r in runs):
            raise RuntimeError(f"{label}: the pair did not run in the expected processes")
        results[label] = {k: (min if k in ("rtt", "p99") else max)(r[k] for r in runs) for k in runs[0]}
    placement = f"{shards} shards; the topics on shard {shard} (node {home[:8]})"
    return results, placement
