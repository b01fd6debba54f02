"""The KV-page market: the cost of one market tick, and what it does for a contended replica's throughput.

Usage: python bench/market.py [--contexts 10000] [--devices 8] [--processes 2500] [--ticks 200]
                              [--inferlets 8] [--pages 64] [--tokens 128] [--runs 2] [--out docs/bench]

A tick is one round per device: each device's report (all its contexts: owner, bid per page, effective pages,
resident or suspended; pages made per process) is settled — make cost, auction, rent, dividends — and its decision
comes back. Demand is 1.25 × every device's capacity, bids drift a little every tick and residents follow the
previous decision, so every round suspends and restores some contexts. Measured in this process (``Market.settle``),
through the Ray actor with one concurrent call per device (as one replica per device makes them) and with all devices
in one call; each with the per-context fields as numpy arrays and as plain lists. CPU ms is this thread's CPU time,
which other load on the machine does not inflate. The goal is a tick under 5 ms for 10k contexts across 8 devices.

Contended throughput: ``--inferlets`` inferlets, each continuing its own 100-token text by ``--tokens`` greedy tokens,
share a replica of the tiny model whose ``--pages`` pages hold about half of what they need. First come first served
is the replica without a market (every bid 0: a context needing a page while others wait in line gives up its own);
the market run reports to a market actor and every Generator bids Pie's default from its balance and remaining
tokens. Each with the replica's host buffer (suspended pages are copied out and back) and without it (they are
recomputed). All runs produce the same tokens; the table compares wall time, tokens/s, suspensions and mean
completion time. Modes alternate, ``--runs`` times each. The tables also go to ``OUT/market.md`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import ray
from pie_cluster.market import Market, get_or_create_market
from pie_cluster.ray_session import NAMESPACE, init_ray
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

OVERLOAD = 1.25
SHARED_PREFIX_PAGES = 4
WARMUP = 10


class Workload:
    """Contexts spread over devices and processes, each with a bid per page and effective pages (own pages plus an
    equal share of a prefix shared by up to four holders)."""

    def __init__(self, contexts: int, devices: int, processes: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.processes = [f"inferlet-{k}" for k in range(processes)]
        self.device = self.rng.integers(0, devices, contexts)
        self.owner = self.rng.integers(0, processes, contexts)
        holders = self.rng.integers(1, 5, contexts)
        self.pages = self.rng.integers(1, 48, contexts) + SHARED_PREFIX_PAGES / holders
        self.bids = self.rng.lognormal(np.log(0.005), 0.5, contexts)
        self.resident = np.zeros(contexts, bool)
        self.suspended = self.restored = 0
        self.devices = [f"replica-{d}/rank0" for d in range(devices)]
        self.capacity = [float(self.pages[self.device == d].sum()) / OVERLOAD for d in range(devices)]

    def reports(self, as_lists: bool) -> list[dict]:
        """One report per device for the next tick (bids drift; each process made a page now and then)."""
        self.bids *= self.rng.lognormal(0, 0.05, self.bids.size)
        made_now = self.rng.random(len(self.processes)) < 0.05
        reports = []
        for d, device in enumerate(self.devices):
            mine = np.flatnonzero(self.device == d)
            present, owners = np.unique(self.owner[mine], return_inverse=True)
            report = {
                "device": device,
                "capacity": self.capacity[d],
                "processes": [self.processes[p] for p in present],
                "owners": owners,
                "contexts": mine,
                "bids": self.bids[mine],
                "pages": self.pages[mine],
                "resident": self.resident[mine],
                "made": made_now[present].astype(np.int64),
            }
            if as_lists:
                report = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in report.items()}
            reports.append(report)
        return reports

    def apply(self, decisions: list[dict]) -> None:
        """Do what the market decided, as the replicas would (counting the churn)."""
        for decision in decisions:
            self.resident[decision["suspend"]] = False
            self.resident[decision["restore"]] = True
            self.suspended += len(decision["suspend"])
            self.restored += len(decision["restore"])


def joined_market(workload: Workload) -> Market:
    market = Market()
    for process in workload.processes:
        market.join(process)
    return market


def joined_actor(workload: Workload):
    actor = get_or_create_market(namespace=NAMESPACE)
    ray.get([actor.join.remote(p) for p in workload.processes])
    return actor


def settle_in_process(market: Market, reports: list[dict]) -> list[dict]:
    return market.settle(reports)


def settle_per_device(actor, reports: list[dict]) -> list[dict]:
    """One concurrent call per device, as one replica per device would make them."""
    return [d for decisions in ray.get([actor.settle.remote([r]) for r in reports]) for d in decisions]


def settle_in_one_call(actor, reports: list[dict]) -> list[dict]:
    return ray.get(actor.settle.remote(reports))


def tick_cost_table(args) -> Table:
    """Market tick cost: in-process and through the actor, with numpy and list payloads."""
    table = Table(
        title=f"market tick: {args.contexts:,} contexts on {args.devices} devices, {args.processes:,} processes, "
        f"{args.ticks} ticks"
    )
    for column in ("where", "payload", "median ms", "p90 ms", "CPU ms", "suspended / tick", "restored / tick"):
        table.add_column(column, justify="right")
    paths = [
        ("in process", joined_market, settle_in_process),
        (f"actor, {args.devices} calls", joined_actor, settle_per_device),
        ("actor, 1 call", joined_actor, settle_in_one_call),
    ]
    for where, make_target, settle in paths:
        for as_lists in (False, True):
            workload = Workload(args.contexts, args.devices, args.processes)
            target = make_target(workload)
            wall, cpu = [], []
            for tick in range(WARMUP + args.ticks):
                reports = workload.reports(as_lists)
                start, start_cpu = time.perf_counter(), time.thread_time()
                decisions = settle(target, reports)
                if tick == WARMUP:
                    workload.suspended = workload.restored = 0
                if tick >= WARMUP:
                    wall.append(time.perf_counter() - start)
                    cpu.append(time.thread_time() - start_cpu)
                workload.apply(decisions)
            if not isinstance(target, Market):
                ray.kill(target)
            table.add_row(
                where,
                "lists" if as_lists else "numpy",
                f"{np.median(wall) * 1e3:.2f}",
                f"{np.percentile(wall, 90) * 1e3:.2f}",
                f"{np.median(cpu) * 1e3:.2f}" if where == "in process" else "-",
                f"{workload.suspended / args.ticks:.0f}",
                f"{workload.restored / args.ticks:.0f}",
            )
    return table


PROMPT_TOKENS = 100


async def continue_text(input):
    """One contending inferlet: its own text, then greedy tokens (the Generator bids by default)."""
    from inferlet import Context, Model, Sampler

    start = time.perf_counter()
    with Context(Model.load("default")) as ctx:
        ctx.append([100 + (i * 7 + input["seed"] * 13) % 50 for i in range(PROMPT_TOKENS)])
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], auto_flush=False).collect_tokens()
    return tokens, time.perf_counter() - start


def contended_run(args, with_market: bool, host_buffer: bool) -> dict:
    from pie_cluster.hosts.in_process import LocalTrust
    from pie_cluster.hosts.run import endpoints_for, run_inferlet
    from pie_cluster.market import MarketActor
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings
    from pie_workers.tiny_model import default_model_path

    market = MarketActor.remote() if with_market else None
    settings = RunnerSettings(num_pages=args.pages, host_pages=None if host_buffer else 0)
    trust = LocalTrust()
    model = default_model_path("llama")
    replica = Replica(model, 1, settings, cpus_per_rank=1, engine=BatchLimits(), market=market, secret=trust.secret)
    endpoints = endpoints_for("default", replica)

    async def all_of():
        runs = [
            run_inferlet(
                continue_text,
                {"seed": i, "tokens": args.tokens},
                endpoints,
                "bench",
                **trust.instance("bench"),
                market=market,
            )
            for i in range(args.inferlets)
        ]
        return await asyncio.gather(*runs)

    try:
        start = time.perf_counter()
        results = asyncio.run(all_of())
        wall = time.perf_counter() - start
        stats = ray.get(replica.leader.engine_stats.remote())
    finally:
        replica.shutdown()
        if market is not None:
            ray.kill(market)
    return {
        "tokens": [t for t, _ in results],
        "wall": wall,
        "suspensions": stats.suspensions,
        "latency": float(np.mean([s for _, s in results])),
    }


def contended_table(args) -> Table:
    table = Table(
        title=f"contended replica: {args.inferlets} inferlets x ({PROMPT_TOKENS} + {args.tokens}) tokens on "
        f"{args.pages} pages of 16 tokens, tiny llama on CPU"
    )
    for column in ("suspended pages", "policy", "wall s", "tokens/s", "vs FCFS", "suspensions", "mean completion s"):
        table.add_column(column, justify="right")
    modes = [(host, market) for host in (True, False) for market in (False, True)]
    runs: dict[tuple[bool, bool], list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.runs):
        for mode in modes:
            runs[mode].append(contended_run(args, with_market=mode[1], host_buffer=mode[0]))
    reference = runs[modes[0]][0]["tokens"]
    assert all(r["tokens"] == reference for rs in runs.values() for r in rs), "a policy changed the tokens"
    generated = args.inferlets * args.tokens
    for host, with_market in modes:
        wall = float(np.median([r["wall"] for r in runs[host, with_market]]))
        fcfs_wall = float(np.median([r["wall"] for r in runs[host, False]]))
        table.add_row(
            "to host memory" if host else "recomputed",
            "market (default bids)" if with_market else "first come, first served",
            f"{wall:.2f}",
            f"{generated / wall:.0f}",
            f"{fcfs_wall / wall:.2f}x",
            f"{np.median([r['suspensions'] for r in runs[host, with_market]]):.0f}",
            f"{np.median([r['latency'] for r in runs[host, with_market]]):.2f}",
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, default=10_000)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--processes", type=int, default=2_500)
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--inferlets", type=int, default=8)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--skip-ticks", action="store_true", help="only the contended-throughput table")
    add_out_option(ap)
    args = ap.parse_args()
    init_ray(num_cpus=4)
    console = Console(width=120)
    tables = [] if args.skip_ticks else [tick_cost_table(args)]
    tables.append(contended_table(args))
    for table in tables:
        console.print(table)
    write_markdown(args.out, "market", tables)


if __name__ == "__main__":
    main()
