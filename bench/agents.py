"""Agentic workloads three ways: inferlets next to the model vs client-side orchestration over OpenAI endpoints.

Usage: python bench/agents.py [--ks 1,8,32,128] [--turns 8] [--tokens 16] [--tool-delay 0.1] [--roles 4]
                              [--workloads react,swarm]
                              [--systems inferlets,openai,responses,vllm,vllm-responses] [--rounds 3]
                              [--cell-timeout 600] [--settle 3] [--out docs/bench]

The Pie paper's method (``shared/reference/agentic-bench.md``): every system does the same work — fixed generated
tokens per turn (greedy, end-of-turn ignored), the same observation text, the same simulated tool delay, the same
model directory on the same two cores (our cluster in its default configuration, which gives the tiny model one
torch thread; vLLM's server two) — so what differs is where the agent loop runs.

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
them, and plots wall time against K to ``OUT/agents.png`` (tables in ``OUT/agents.md``). After a warm-up, each
(workload, K, system) cell runs ``--rounds`` times and reports its median, the ratios being those of the medians;
vLLM's server runs beside our cluster, so each round runs a K's systems back to back, each after ``--settle``
idle seconds (a server keeps a core busy for a second or two after its last request). A cell that fails (an
exception, a dropped connection, a round past ``--cell-timeout``) shows why in its place and the bench goes on; a
vLLM server found dead is started again for the next cell that needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Coroutine
from contextlib import closing
from dataclasses import dataclass, field

import httpx
import openai
import ray
import vllm_peer
from agents_report import SYSTEMS, Cell, Cells, reason, report
from local_pie import LocalPie, local_pie
from pie_cluster.config import ResponsesConfig
from pie_cluster.hosts.events import follow
from pie_cluster.launch_request import LaunchRequest
from pie_workers.tiny_model import default_model_path
from report import add_out_option
from rich.console import Console

MODEL = "default"
APIS = {"openai": "chat", "responses": "responses", "vllm": "chat", "vllm-responses": "responses"}
SYSTEM = "You are a research agent. Think, then call a tool, then read its observation."
ROLE = "You are agent {role} of a pipeline. Add to the text you are given."
OBSERVATION = (
    "Observation: the tool returned 3 results about paged attention, KV caches and batching; the first one says "
    "pages are 16 tokens."
)

AGENT_PROGRAM = '''
import asyncio
import json
import time

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
    return []


async def swarm_role(model, a):
    role, roles, turns, prefix = a["role"], a["roles"], a["turns"], a["topic"]
    hops = list(range(role, turns, roles))
    handoffs = []  # ms from a push to its pull's return (one node: the clocks agree)
    with Context(model) as ctx:
        ctx.system(a["system"])
        text = a["task"]
        for hop in hops:
            if hop:
                handed = json.loads(await messaging.pull(f"{prefix}-{hop}"))
                handoffs.append((time.time() - handed["at"]) * 1000)
                text = handed["text"]
            ctx.user(text)
            text = await turn(ctx, a["tokens"]).collect_text()
            ctx.seal()
            if hop + 1 < turns:
                messaging.push(f"{prefix}-{hop + 1}", json.dumps({"at": time.time(), "text": text}))
    return handoffs


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


async def run_inferlets(launcher, program: str, inputs: list[dict], handoffs: list[float]) -> None:
    """Run one inferlet per input to its end; the swarm's bus hand-off times (ms) go to ``handoffs``."""
    ids = await asyncio.gather(
        *(launcher.launch.remote("bench", LaunchRequest(program=program, input=i)) for i in inputs)
    )

    async def ended(instance: str) -> None:
        async for events in follow(launcher, "bench", instance, abort_on_close=True):  # a cancelled round aborts
            for _, kind, value in events:
                if kind == "error":
                    raise RuntimeError(f"agent inferlet failed: {value}")
                if kind == "return":
                    handoffs.extend(json.loads(value))

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


# -- vLLM's server ---------------------------------------------------------------------------------------------------


# -- driver ----------------------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """What every round of every cell needs: the options, our cluster, the uploaded agent program, vLLM's server."""

    args: argparse.Namespace
    pie: LocalPie
    program: str
    vllm: vllm_peer.RestartingServer
    vllm_warmed: int = 0  # the vLLM server start that had its warm-up
    handoffs: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (workload, K) -> ms, all rounds

    def systems(self) -> list[str]:
        runs = [s for s in SYSTEMS if s in self.args.systems]
        return [s for s in runs if self.vllm.skipped is None or not s.startswith("vllm")]

    def work(self, system: str, workload: str, k: int, run: str) -> Coroutine:
        """One round of ``system``; ``run`` names it, so no two rounds share a swarm topic."""
        if system == "inferlets":
            inputs, handoffs = inferlet_inputs(workload, k, self.args, run), self.handoffs.setdefault((workload, k), [])
            return run_inferlets(self.pie.launcher, self.program, inputs, handoffs)
        url = self.vllm.url() if system.startswith("vllm") else f"{self.pie.url}/v1"
        if system.startswith("vllm") and self.vllm_warmed < self.vllm.starts:  # a restarted server starts cold
            self.vllm_warmed = self.vllm.starts
            timed(run_clients(url, workload, 2, self.args, APIS[system]), self.args.cell_timeout)
        return run_clients(url, workload, k, self.args, APIS[system])


def timed(work: Coroutine, timeout: float) -> float:
    """Wall seconds of one round; one past ``timeout`` is cancelled (its inferlets aborted) and raises."""

    async def bounded() -> float:
        began, scope = time.perf_counter(), asyncio.timeout(timeout)
        try:
            async with scope:
                await work
        except TimeoutError:
            if scope.expired():
                raise TimeoutError(f"a round ran past {timeout:g} s") from None
            raise
        return time.perf_counter() - began

    return asyncio.run(bounded())


def warm_up(bench: Bench, console: Console) -> None:
    """A small round of every system and workload first: compile, connect, fill caches. A failure is only logged:
    the measured cells record their own."""
    for n, workload in enumerate(bench.args.workloads):
        for system in bench.systems():
            try:
                timed(bench.work(system, workload, 2, f"warm{n}"), bench.args.cell_timeout)
            except Exception as error:
                console.log(f"warm-up of {system} on {workload} failed: {reason(error)}", markup=False)


def run_round(bench: Bench, cells: Cells, key: tuple[str, int, str], run: str, console: Console) -> None:
    """One round of one cell. A failure marks the cell failed, skipping its later rounds, and the bench goes on."""
    cell = cells.setdefault(key, Cell())
    if cell.failed:
        return
    workload, k, system = key
    time.sleep(bench.args.settle)  # what ran before (vLLM's server spins ~2 s after its requests) quiets down
    try:
        cell.seconds.append(timed(bench.work(system, workload, k, run), bench.args.cell_timeout))
    except Exception as error:
        cell.failed = reason(error)
        console.log(f"{workload} K={k} {system} failed: {error!r}", markup=False)


def summary(cells: Cells, workload: str, k: int) -> str:
    parts = [(s, cells.get((workload, k, s))) for s in SYSTEMS]
    shown = [f"{s} failed" if c.failed else f"{s} {c.median:.1f} s" for s, c in parts if c and (c.failed or c.seconds)]
    return f"{workload} K={k} (median): " + ", ".join(shown)


def measure(args, console: Console) -> tuple[Cells, list[str]]:
    """Every system, K by K, ``rounds`` times: our cluster and (installed and asked for) vLLM's server run side by
    side, and each round runs a K's systems back to back, so they share the load of this shared machine and a slow
    spell lands in one round of each rather than in all of one system's. Returns the cells and notes (vLLM's server,
    the swarm's bus hand-offs)."""
    asked = {"vllm", "vllm-responses"} & set(args.systems)
    vllm = vllm_peer.RestartingServer(
        vllm_peer.available() if asked else "not asked for", default_model_path(), MODEL, describe=reason
    )
    cells: Cells = {}
    with local_pie(pages=args.pages, responses=ResponsesConfig(park_s=args.park_s)) as pie, closing(vllm):
        program = ray.get(pie.launcher.upload.remote("bench", "agent.py", AGENT_PROGRAM.encode())).program
        bench = Bench(args, pie, program, vllm)
        warm_up(bench, console)
        for workload in args.workloads:
            for k in args.ks:
                for n in range(args.rounds):
                    for system in bench.systems():
                        run_round(bench, cells, (workload, k, system), f"{workload}{k}r{n}", console)
                console.log(summary(cells, workload, k), markup=False)
    return cells, [vllm.note(), *handoff_notes(bench, args)]


def handoff_notes(bench: Bench, args) -> list[str]:
    """The swarm's hand-offs between inferlets over the bus, from push to pull, over every round of each K."""
    notes = []
    for k in args.ks:
        got = sorted(bench.handoffs.get(("swarm", k), []))
        if got:
            p50, p90 = got[len(got) // 2], got[int(len(got) * 0.9)]
            notes.append(f"swarm K={k}: bus hand-off p50 {p50:.2f} ms, p90 {p90:.2f} ms ({len(got)} hand-offs)")
    return notes


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
    park = "our Responses API's [responses] park_s (0: each turn launches an instance and saves a snapshot)"
    ap.add_argument("--park-s", type=float, default=30.0, help=park)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per cell; the tables report their median")
    ap.add_argument("--cell-timeout", type=float, default=600, help="seconds one round of one cell may take")
    ap.add_argument("--settle", type=float, default=3.0, help="idle seconds before each round of each cell")
    add_out_option(ap)
    args = ap.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.workloads, args.systems = args.workloads.split(","), args.systems.split(",")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=120)

    cells, notes = measure(args, console)
    notes += [
        "responses: each turn sends only its new input with previous_response_id (store on); openai and vllm: "
        "chat completions re-sending the whole conversation",
    ]
    report(args, cells, notes, console)


if __name__ == "__main__":
    main()
