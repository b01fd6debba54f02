"""What surviving a replica costs: inferlets whose contexts keep their lineage (as in a cluster, where every endpoint
names a replica to fail over to) against the same inferlets without it, and how long inferlets stall when their
replica is killed under them.

Usage: python bench/failover.py [--tokens 128] [--concurrency 1,8,32] [--rounds 5] [--kills 3] [--out docs/bench]

(a) aggregate greedy decode tokens/s of N inferlets on one replica, stepping (a pass per token, whose answer carries
    the token it wrote) and collecting (chained passes), with the lineage mirrored and without; each round runs both
    back to back, the table reports medians and the median ratio;
(b) 32 inferlets stepping ``--tokens`` greedy tokens each on replica A, SIGKILLed once they made a quarter of them
    all together; each moves to replica B. Reported: each inferlet's longest gap between two steps (the stall the
    failure cost it: its contexts recomputed there, the pass in flight sent again) against the same gap in a run
    without the kill, and the whole run's time against that run's.
Both replicas use ``--threads`` torch threads. Tables go to ``OUT/failover.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import time
from statistics import median

import ray
import torch
import uvloop
from inferlet import Context, Model, Sampler
from pie_cluster.hosts.run import endpoints_for
from pie_cluster.ray_session import init_ray
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings
from pie_workers.tiny_model import default_model_path
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table
from tax import TRUST, started_together

PROMPT = 32
KILLED_WITH = 32  # inferlets on the replica killed in (b)


async def generate(input: dict) -> list[float]:
    """Prefill, wait for every peer, then ``tokens`` greedy steps; returns the time of each step's end."""
    with Context(Model.load("default")) as ctx:
        ctx.append(input["prompt"])
        await ctx.flush()
        ctx.append([input["prompt"][-1]])
        input["ready"].set_result(None)
        await input["go"]
        gen = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop=[], auto_flush=False)
        if not input["stepping"]:
            await gen.collect_tokens()
            return [time.perf_counter()]
        ends = [time.perf_counter()]
        async for step in gen:
            await step.execute()
            ends.append(time.perf_counter())
            input["progress"]()
        return ends


async def run(endpoints, n: int, tokens: int, rng: random.Random, stepping: bool, on_progress=None):
    """``n`` inferlets decoding together: (tokens/s over the run, each one's step end times)."""
    inputs = [
        {
            "prompt": [rng.randrange(3, 4096) for _ in range(PROMPT)],
            "tokens": tokens,
            "stepping": stepping,
            "progress": on_progress or (lambda: None),
        }
        for _ in range(n)
    ]
    start, ends = await started_together(generate, endpoints, inputs, TRUST)
    return n * tokens / (max(e[-1] for e in ends) - start), ends


def mirrored(endpoints: dict, survivor: Replica) -> dict:
    (after,) = endpoints_for("default", survivor).values()
    return {name: dataclasses.replace(e, failover=(after.address,)) for name, e in endpoints.items()}


async def killed_midway(doomed: Replica, survivor: Replica, tokens: int, rng: random.Random):
    """(b) once: the run with the kill, its tokens/s and each inferlet's step end times."""
    pid = ray.get(doomed.leader.ping.remote())
    steps, quarter = [0], KILLED_WITH * tokens // 4

    def progress() -> None:
        steps[0] += 1
        if steps[0] == quarter:
            os.kill(pid, signal.SIGKILL)

    endpoints = mirrored(endpoints_for("default", doomed), survivor)
    return await run(endpoints, KILLED_WITH, tokens, rng, stepping=True, on_progress=progress)


def longest_gap(ends: list[float]) -> float:
    return max(b - a for a, b in zip(ends, ends[1:], strict=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kills", type=int, default=3, help="runs of (b), each killing a fresh replica")
    ap.add_argument("--threads", type=int, default=1)
    add_out_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(n) for n in args.concurrency.split(",")]
    init_ray(num_cpus=4)
    model_dir = default_model_path("llama")
    settings = RunnerSettings(num_pages=KILLED_WITH * 16 + max(levels) * 16 + 64, backend="torch")

    def replica() -> Replica:
        return Replica(model_dir, 1, settings, cpus_per_rank=args.threads, engine=BatchLimits(), secret=TRUST.secret)

    survivor, rng, console = replica(), random.Random(0), Console()
    plain = endpoints_for("default", survivor)
    costs = {(n, s): [] for n in levels for s in (True, False)}  # (mirrored, plain) tokens/s per round
    for _ in range(args.rounds):
        for n, stepping in costs:
            with_mirror = uvloop.run(run(mirrored(plain, survivor), n, args.tokens, rng, stepping))[0]
            costs[n, stepping].append((with_mirror, uvloop.run(run(plain, n, args.tokens, rng, stepping))[0]))
    cost = Table(title=f"(a) tokens/s with the lineage mirrored vs not, tiny Llama, medians of {args.rounds} rounds")
    for col in ("inferlets", "passes", "mirrored", "not mirrored", "ratio"):
        cost.add_column(col, justify="right")
    for (n, stepping), pairs in costs.items():
        cost.add_row(
            str(n),
            "stepping" if stepping else "collecting",
            f"{median(m for m, _ in pairs):,.0f}",
            f"{median(p for _, p in pairs):,.0f}",
            f"{median(m / p for m, p in pairs):.3f}",
        )
    console.print(cost)

    stalls = []  # (killed run: median longest gap, run time; clean run: the same)
    for _ in range(args.kills):
        doomed = replica()
        uvloop.run(run(endpoints_for("default", doomed), 8, 16, rng, True))  # warm, as the survivor is
        clean_rate, clean = uvloop.run(run(endpoints_for("default", doomed), KILLED_WITH, args.tokens, rng, True))
        killed_rate, killed = uvloop.run(killed_midway(doomed, survivor, args.tokens, rng))
        doomed.shutdown()
        stalls.append((median(map(longest_gap, killed)), median(map(longest_gap, clean)), clean_rate / killed_rate))
    stall = Table(title=f"(b) {KILLED_WITH} inferlets whose replica is killed a quarter of the way, {args.kills} runs")
    for col in ("run", "longest step gap, killed", "without the kill", "run time killed / not"):
        stall.add_column(col, justify="right")
    for i, (gap, clean_gap, slower) in enumerate(stalls, 1):
        stall.add_row(str(i), f"{gap * 1000:.0f} ms", f"{clean_gap * 1000:.0f} ms", f"{slower:.2f}")
    console.print(stall)
    survivor.shutdown()
    write_markdown(args.out, "failover", [cost, stall])


if __name__ == "__main__":
    main()
