"""What a context costs to move when its replica leaves: its KV pages handed to another replica (through Ray's object
store, then claimed by the inferlet) against recomputing it from its tokens there (what failover does when the
replica died).

Usage: python bench/handover.py [--models tiny,bigger] [--tp 1,2] [--tokens 2048] [--repeats 3] [--threads 1]
                                [--out docs/bench]

Per model and tensor-parallel size, two replicas on a local Ray (a group's pages move rank to rank). One inferlet
prefills a context of ``--tokens`` random tokens on the first, steps a few greedy tokens, and waits; then the first
replica either hands its contexts over (``control.handover.hand_over``, as ``pie drain`` and the scaler do) or is
SIGKILLed, and the inferlet's next step lands on the second. Reported (medians over ``repeats``, each on a fresh
first replica, the modes interleaved): the handover's own time, the inferlet's first step after the move, a plain
step there, and the move's cost: the handover plus the first step's excess over a plain step (transfer), or that
excess alone (recompute: the context's prefill run again on the second replica). Models: the embedded tiny Llama and
a bigger random-weight Llama (hidden 1,024, 8 layers, ``random_model``). Writes ``OUT/handover.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import signal
import time
from statistics import median

import ray
from inferlet import Context, Model, Sampler
from pie_cluster.control.handover import hand_over
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_cluster.ray_session import init_ray
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings
from pie_workers.tiny_model import default_model_path
from random_model import random_llama
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table
from tax import TRUST

STEPS = 3  # plain steps timed before and after the move


async def one_step(ctx: Context) -> float:
    start = time.perf_counter()
    await ctx.generate(Sampler.argmax(), max_tokens=1, stop=[]).collect_tokens()
    return time.perf_counter() - start


async def inferlet(input: dict) -> dict:
    """Prefill, a few steps, wait for the move; then the first step after it and a few plain ones."""
    ctx = Context(Model.load("default"))
    ctx.append(input["prompt"])
    await ctx.flush()
    for _ in range(STEPS):
        await one_step(ctx)
    input["ready"].set()
    await input["moved"].wait()
    first = await one_step(ctx)
    plain = [await one_step(ctx) for _ in range(STEPS)]
    link = Model.load("default").link
    return {"first": first, "plain": median(plain), "moves": link.moves, "transferred": link.transferred}


def replica(model_dir, tp: int, settings: RunnerSettings, threads: int) -> Replica:
    return Replica(model_dir, tp, settings, cpus_per_rank=threads, engine=BatchLimits(), secret=TRUST.secret)


def measure(model_dir, tp: int, survivor: Replica, settings, threads: int, tokens: int, transfer: bool) -> dict:
    leaving = replica(model_dir, tp, settings, threads)
    try:
        (endpoint,) = endpoints_for("default", leaving).values()
        (after,) = endpoints_for("default", survivor).values()
        endpoints = {"default": dataclasses.replace(endpoint, failover=(after.address,))}
        prompt = [random.Random(tokens).randrange(3, 4000) for _ in range(tokens - 2 * STEPS - 2)]

        async def main() -> dict:
            input = {"prompt": prompt, "ready": asyncio.Event(), "moved": asyncio.Event()}
            running = asyncio.ensure_future(
                run_inferlet(inferlet, input, endpoints, "alice", **TRUST.instance("alice"))
            )
            await input["ready"].wait()
            start = time.perf_counter()
            if transfer:
                assert await asyncio.to_thread(hand_over, leaving, survivor) is not None, "the handover failed"
            else:
                os.kill(ray.get(leaving.leader.ping.remote()), signal.SIGKILL)
            handover = time.perf_counter() - start if transfer else 0.0
            input["moved"].set()
            return {**await running, "handover": handover}

        got = asyncio.run(main())
        assert got["moves"] == 1 and got["transferred"] == (1 if transfer else 0), got
        return got
    finally:
        leaving.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,bigger")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_out_option(ap)
    args = ap.parse_args()
    sizes = [int(tp) for tp in args.tp.split(",")]
    init_ray(num_cpus=4 * max(sizes))
    settings = RunnerSettings(num_pages=args.tokens // 16 * 3, backend="torch")
    models = {"tiny": default_model_path("llama"), "bigger": random_llama()}
    table = Table(title=f"moving a {args.tokens:,}-token context to another replica (ms, medians of {args.repeats})")
    columns = ("model", "ranks", "mode", "handover", "first step there", "plain step", "move costs", "vs recompute")
    for column in columns:
        table.add_column(column)
    rows = []
    for name in args.models.split(","):
        for tp in sizes:
            survivor = replica(models[name], tp, settings, args.threads)
            try:
                runs = {True: [], False: []}
                for _ in range(args.repeats):
                    for transfer in (True, False):
                        runs[transfer].append(
                            measure(models[name], tp, survivor, settings, args.threads, args.tokens, transfer)
                        )
            finally:
                survivor.shutdown()
            cost = {}
            for transfer in (True, False):
                r = runs[transfer]
                handover, first, plain = (1e3 * median(x[k] for x in r) for k in ("handover", "first", "plain"))
                cost[transfer] = handover + first - plain
                rows.append((name, "transfer" if transfer else "recompute", handover, first, plain))
            for row in rows[-2:]:
                mode_cost = cost[row[1] == "transfer"]
                table.add_row(row[0], str(tp), row[1], f"{row[2]:.1f}", f"{row[3]:.1f}", f"{row[4]:.1f}",
                              f"{mode_cost:.1f}", f"{mode_cost / cost[False]:.2f}x")  # fmt: skip
    Console().print(table)
    write_markdown(args.out, "handover", [table])


if __name__ == "__main__":
    main()
