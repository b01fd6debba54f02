"""Prefix-aware placement vs least-loaded over two replicas of the tiny model, from the outside (the `openai` client),
and what keeping each user's prefix cache to that user costs.

Workload: ``--prompts`` long system prompts (~400 tokens each), each shared by ``--requests / --prompts`` chat
requests with short distinct user questions, in a shuffled order, sent by ``--clients`` concurrent clients with
``max_tokens`` 16 and temperature 0, streamed. The requests come from ``--users`` users in turn, who all send the
same system prompts: with ``[cache] share = "user"`` (the default) each user's first request of a prompt computes it
again on its replica, with ``share = "cluster"`` every user's requests reuse it (``--share`` runs both).
Each replica has ``--pages`` KV pages, by default two settings: 200 (16 tokens each), enough for about half of the
system prompts (25 pages each) plus the running requests' own pages, so spreading every family over both replicas
(least loaded) makes each replica cache all of them and evict, while placing a family on one replica (prefix)
halves what each must keep; and 4096, where everything fits anyway and least loaded only computes each prompt once
more.

Reported per routing and sharing: prompt tokens, those the replicas served from their prefix tries
(``prefix_hit_tokens`` of the engine stats, summed over replicas), the hit rate, the median time to the first
token, and requests/s; with the split of hits over the replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass

import httpx
import openai
import ray
from local_pie import local_pie
from pie_cluster.control.lifecycle import CONTROLLER
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

MODEL = "default"
WORDS = [
    "shipping",
    "parcel",
    "invoice",
    "refund",
    "customs",
    "warehouse",
    "courier",
    "tracking",
    "delivery",
    "address",
    "signature",
    "damaged",
    "insurance",
    "weight",
    "dimensions",
    "label",
    "pallet",
    "container",
    "freight",
    "express",
    "standard",
    "holiday",
    "weekend",
    "tariff",
    "broker",
    "contract",
    "liability",
    "claim",
    "schedule",
    "pickup",
    "depot",
    "route",
    "driver",
    "vehicle",
    "fuel",
    "surcharge",
    "discount",
    "loyalty",
    "account",
]


@dataclass(frozen=True)
class Job:
    family: int
    system: str
    question: str
    user: int = 0


@dataclass(frozen=True)
class Outcome:
    routing: str
    share: str
    requests: int
    failed: int
    prompt_tokens: int
    hit_tokens: int
    per_replica_hits: tuple[int, ...]
    seconds: float
    ttft_s: float  # median time to the first streamed token


def system_prompts(n: int, words: int) -> list[str]:
    """``n`` distinct long system prompts (distinct from their first characters, as real deployments' are)."""
    out = []
    for k in range(n):
        rng = random.Random(k)
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(f"Assistant profile #{k}: you answer for desk {k} of the company. Rules: {body}.")
    return out


def jobs(requests: int, prompts: list[str], users: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    out = [
        Job(
            i % len(prompts),
            prompts[i % len(prompts)],
            f"Question {i}: where is parcel {rng.randrange(10**6)}?",
            (i // len(prompts)) % users,
        )
        for i in range(requests)
    ]
    rng.shuffle(out)
    return out


def replica_hits() -> tuple[int, ...]:
    """Prompt tokens each replica has served from its prefix trie so far (the controller's status)."""
    rows = ray.get(ray.get_actor(CONTROLLER).status.remote()).replicas
    return tuple(r.prefix_hit_tokens or 0 for r in sorted(rows, key=lambda r: r.replica))


def token(user: int) -> str:
    return f"tok-user{user}"


async def drive(url: str, work: list[Job], clients: int, max_tokens: int) -> tuple[int, int, float, list[float]]:
    """Send every job (as its user) with ``clients`` concurrent clients, streamed; (prompt tokens, failures,
    seconds, each request's time to its first token)."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        users = {job.user for job in work}
        client = {
            u: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token(u), http_client=http, max_retries=0)
            for u in users
        }
        queue = list(reversed(work))
        prompt_tokens = failed = 0
        ttfts: list[float] = []

        async def worker() -> None:
            nonlocal prompt_tokens, failed
            while queue:
                job = queue.pop()
                messages = [{"role": "system", "content": job.system}, {"role": "user", "content": job.question}]
                try:
                    sent, first = time.perf_counter(), None
                    stream = await client[job.user].chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        max_tokens=max_tokens,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter() - sent
                        if chunk.usage is not None:
                            prompt_tokens += chunk.usage.prompt_tokens
                    ttfts.append(first if first is not None else time.perf_counter() - sent)
                except openai.APIError as e:
                    failed += 1
                    print(f"  request failed: {e}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return prompt_tokens, failed, time.perf_counter() - start, ttfts


def run(routing: str, share: str, pages: int, args: argparse.Namespace) -> Outcome:
    prompts = system_prompts(args.prompts, args.words)
    work = jobs(args.requests, prompts, args.users)
    tokens = {token(u): f"user{u}" for u in range(args.users)}
    with local_pie(
        pages=pages, cpus_per_rank=1, replicas=2, routing=routing, sandbox="off", tokens=tokens, share=share
    ) as pie:
        warm = [Job(-1, f"Warm-up {i}.", "Hello?") for i in range(2)]  # loads the program and tokenizer
        asyncio.run(drive(pie.url, warm, 2, 2))
        before = replica_hits()
        prompt_tokens, failed, seconds, ttfts = asyncio.run(drive(pie.url, work, args.clients, args.max_tokens))
        after = replica_hits()
    per_replica = tuple(a - b for a, b in zip(after, before, strict=True))
    ttft = statistics.median(ttfts) if ttfts else float("nan")
    return Outcome(routing, share, len(work), failed, prompt_tokens, sum(per_replica), per_replica, seconds, ttft)


def table(outcomes: list[Outcome], pages: int, args: argparse.Namespace) -> Table:
    t = Table(
        title=f"{args.requests} chat requests from {args.users} users, {args.prompts} system prompts, "
        f"{args.clients} clients, 2 replicas x {pages} pages, max_tokens {args.max_tokens}"
    )
    columns = (
        "routing",
        "share",
        "requests ok",
        "prompt tokens",
        "from cache",
        "hit rate",
        "hits per replica",
        "TTFT p50 ms",
        "req/s",
    )
    for name in columns:
        t.add_column(name, justify="left" if name in ("routing", "share") else "right")
    for o in outcomes:
        rate = o.hit_tokens / o.prompt_tokens if o.prompt_tokens else 0.0
        t.add_row(
            o.routing,
            o.share,
            f"{o.requests - o.failed}/{o.requests}",
            str(o.prompt_tokens),
            str(o.hit_tokens),
            f"{rate:.1%}",
            " / ".join(map(str, o.per_replica_hits)),
            f"{o.ttft_s * 1000:.0f}",
            f"{(o.requests - o.failed) / o.seconds:.1f}",
        )
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--words", type=int, default=100, help="words per system prompt (~3.8 tokens each here)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--users", type=int, default=4, help="users sending the requests in turn (same system prompts)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pages", type=int, nargs="+", default=[200, 4096], help="KV pages per replica (16 tokens each)")
    ap.add_argument("--routing", nargs="+", default=["prefix", "least_loaded"], choices=["prefix", "least_loaded"])
    ap.add_argument("--share", nargs="+", default=["user", "cluster"], choices=["user", "cluster"], help="[cache]")
    add_out_option(ap)
    args = ap.parse_args()
    logging.getLogger("ray").setLevel(logging.WARNING)
    load = os.getloadavg()
    tables = [
        table([run(routing, share, pages, args) for routing in args.routing for share in args.share], pages, args)
        for pages in args.pages
    ]
    for t in tables:
        Console().print(t)
    note = (
        f"Load average before the runs: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min), on a machine "
        "shared with other work. Hit rate: prompt tokens the replicas took from their prefix tries instead of "
        "computing, over all prompt tokens (the last partial page and the question are always computed). "
        'share "user": a user finds only the pages of their own requests (the default, no user can tell from a hit '
        'or its timing what another sent); "cluster": every user finds every page. TTFT: median time from sending a '
        "streamed request to its first token."
    )
    print(note)
    write_markdown(args.out, "prefix_routing", [*tables, note])


if __name__ == "__main__":
    main()
