"""The programmability tax: inferlets on a Ray replica vs the same model runner driven by a plain in-process loop.

Usage: python bench/tax.py [--tokens 128] [--concurrency 1,8,32,64] [--rounds 7] [--threads 2] [--backend torch]
                           [--out docs/bench]

(a) per-token latency of one inferlet generating greedily vs the in-process loop at batch 1 — the difference is the
    tax in ms/token (channel round trip, engine bookkeeping, scheduling, SDK) — both collecting (``collect_tokens``,
    which chains its steps) and stepping with ``async for`` (a round trip per token, which the replica's step run
    ahead overlaps with the forward when a core is free for it), and the CPU the inferlet's process spends per token
    (steadier than wall time on a shared machine: what the SDK's side of the tax costs);
(b) aggregate tokens/s of N concurrent inferlets vs the in-process loop decoding N sequences as one batch.
Both sides use ``--threads`` torch threads: the forward takes that many cores of this 2-core machine, and with 1 a
core is left to the inferlets and the engine, as on a GPU host. The inferlets run in this process on uvloop (as in
an inferlet host: Ray's async actors run on it, and ray[serve] installs it), the model in the replica actor. Each
round runs the loop and then the inferlets back to back, and the tables report medians over rounds: on a shared
machine a burst of outside load then hits one round's pair, not one side of every comparison. The tables go to
``OUT/tax.md`` and the aggregate throughput to the plot ``OUT/tax.png`` as well (see bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from statistics import median

import torch
import uvloop
from forward import paged_decode
from inferlet import Context, Model, Sampler
from pie_cluster.hosts.in_process import LocalTrust
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_cluster.ray_session import init_ray
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.tiny_model import default_model_path
from pie_workers.wire.pages import pages_for
from report import add_out_option, bar_plot, write_markdown
from rich.console import Console
from rich.table import Table

TRUST = LocalTrust()  # this process is the trusted side: its replica and bus verify what it mints
PROMPT = 32


async def timed_generation(input: dict) -> tuple[float, float]:
    """Prefill, wait for every peer, then time ``tokens`` greedy steps; returns (start, end)."""
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.append(input["prompt"])
        await ctx.flush()
        ctx.append([input["prompt"][-1]])
        input["ready"].set_result(None) if not input["ready"].done() else None
        await input["go"]
        start = time.perf_counter()
        gen = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop=[], auto_flush=False)
        if input["stepping"]:  # a round trip per token, as an inferlet that looks at every step makes
            got = [t async for step in gen for t in (await step.execute()).tokens]
        else:
            got = await gen.collect_tokens()
        assert len(got) == input["tokens"]
        return start, time.perf_counter()


async def started_together(main, endpoints, inputs: list[dict], trust: LocalTrust = TRUST) -> tuple[float, list]:
    """Run one inferlet per input, each given ``ready`` (a future it sets once prefilled) and ``go`` (one it awaits
    before it is timed), so all start decoding at once; returns when they did, and what each returned."""
    loop = asyncio.get_running_loop()
    go = loop.create_future()
    for input in inputs:
        input |= {"ready": loop.create_future(), "go": go}
    runs = [asyncio.ensure_future(run_inferlet(main, i, endpoints, "bench", **trust.instance("bench"))) for i in inputs]
    await asyncio.gather(*(i["ready"] for i in inputs))
    start = time.perf_counter()
    go.set_result(None)
    return start, await asyncio.gather(*runs)


async def concurrent(endpoints, n: int, tokens: int, rng: random.Random, stepping: bool = False) -> float:
    """Aggregate tokens/s of n inferlets decoding together (``stepping``: one step at a time, else collecting)."""
    inputs = [
        {"prompt": [rng.randrange(3, 4096) for _ in range(PROMPT)], "tokens": tokens, "stepping": stepping}
        for _ in range(n)
    ]
    _, spans = await started_together(timed_generation, endpoints, inputs)
    return n * tokens / (max(e for _, e in spans) - min(s for s, _ in spans))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the replica's rank and of the loop")
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"), help="the model backend of both sides")
    add_out_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(n) for n in args.concurrency.split(",")]
    model_dir = default_model_path("llama")
    pages = levels[-1] * pages_for(PROMPT + args.tokens + 2, 16) + 64

    init_ray(num_cpus=4)
    settings = RunnerSettings(num_pages=pages, backend=args.backend)
    replica = Replica(model_dir, 1, settings, cpus_per_rank=args.threads, engine=BatchLimits(), secret=TRUST.secret)
    endpoints = endpoints_for("default", replica)
    local = ModelRunner(model_dir, settings)
    gc.freeze()  # as an inferlet host and the replica's ranks do after start-up (the loop runs here too)
    rng = random.Random(0)

    rounds = {n: [] for n in levels}  # (inferlets tokens/s, loop tokens/s) per round
    stepping = []  # (one inferlet stepping tokens/s, loop tokens/s) per round
    cpu = {"collecting": [], "stepping with async for": []}  # the inferlet's process: CPU ms per token, per round
    for _ in range(args.rounds):
        for n in levels:
            prompts = [[rng.randrange(3, 4096) for _ in range(PROMPT)] for _ in range(n)]
            base = paged_decode(local, prompts, args.tokens)
            began = time.process_time()
            rounds[n].append((uvloop.run(concurrent(endpoints, n, args.tokens, rng)), base))
            if n == 1:
                cpu["collecting"].append((time.process_time() - began) * 1000 / args.tokens)
                began = time.process_time()
                stepping.append((uvloop.run(concurrent(endpoints, 1, args.tokens, rng, stepping=True)), base))
                cpu["stepping with async for"].append((time.process_time() - began) * 1000 / args.tokens)
    replica.shutdown()

    console = Console()
    notes, taxes = [], []
    for label, short, pairs in (
        ("collecting", "collecting", rounds.get(1)),
        ("stepping with async for", "stepping (async for)", stepping),
    ):
        if not pairs:
            continue
        ms = [(1000 / ours, 1000 / base) for ours, base in pairs]
        taxes.append(f"{median(o - b for o, b in ms):.2f} ms/token {short}")
        notes.append(
            f"(a) one inferlet {label}: {median(o for o, _ in ms):.3f} ms/token vs in-process loop "
            f"{median(b for _, b in ms):.3f} ms/token -> programmability tax {median(o - b for o, b in ms):.3f} "
            f"ms/token (median of {args.rounds} rounds); the inferlet's process (the SDK's side, its prefill and the "
            f"Ray driver's threads included) {median(cpu[label]):.3f} ms of CPU per token"
        )
        console.print(notes[-1])
    table = Table(
        title=f"(b) aggregate decode tokens/s, {args.tokens} tokens per sequence, tiny Llama, {args.backend} backend, "
        f"{args.threads} threads, medians"
    )
    for col in ("inferlets / batch", "inferlets on Ray", "in-process loop", "ratio"):
        table.add_column(col, justify="right")
    ours = [median(o for o, _ in pairs) for pairs in rounds.values()]
    base = [median(b for _, b in pairs) for pairs in rounds.values()]
    ratios = [median(o / b for o, b in pairs) for pairs in rounds.values()]
    for n, o, b, r in zip(rounds, ours, base, ratios, strict=True):
        table.add_row(str(n), f"{o:,.0f}", f"{b:,.0f}", f"{r:.2f}")
    console.print(table)
    name = "tax" if args.backend == "torch" else f"tax-{args.backend}"
    write_markdown(args.out, name, [*notes, table])
    bar_plot(
        args.out,
        name,
        title=f"Inferlets on Ray vs an in-process loop: greedy decode, tiny Llama, {args.backend} backend, "
        f"{args.threads} threads, "
        f"{args.rounds} rounds" + (f"\nTax of one inferlet: {', '.join(taxes)}" if taxes else ""),
        xlabel="concurrent inferlets (loop: batch size)",
        ylabel="tokens/s",
        categories=[str(n) for n in rounds],
        series={"inferlets on Ray": ours, "in-process loop": base},
        ratios=ratios,
    )


if __name__ == "__main__":
    main()
