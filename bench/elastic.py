"""A load ramp on an autoscaled cluster: replicas over time against the load, and what following the load costs
against a fixed cluster of ``max_replicas``.

Usage: python bench/elastic.py [--base-rate 0.5] [--peak 8] [--ramp-s 60] [--hold-s 30] [--tokens 64]
                               [--max-replicas 3] [--target-load 2] [--upscale-delay-s 3] [--downscale-delay-s 10]
                               [--smoke] [--json PATH] [--out docs/bench]

Each run gets a cluster of its own on Ray's real autoscaler (``autoscaling_cluster.LocalAutoscalingCluster``): a
head with one CPU, where no replica fits, and fake worker nodes of ``cpus_per_rank`` CPUs that the autoscaler starts
for a pending replica and stops once idle. Streamed chat requests of ``tokens`` greedy tokens arrive open-loop
(Poisson, seeded) at a rate that holds at ``base-rate``, rises ``peak``-fold over ``ramp-s``, holds, falls back and
holds again. Every second the bench reads the model's replicas, their target and the live worker nodes.

Runs: **autoscaled** (``min_replicas = 1``, ``max_replicas``, ``target_load`` contexts per replica) and **fixed**
(``replicas = max_replicas`` from the start). Reported: time to first token p50/p90 over the ramp, requests that
failed, replica-seconds spent during the ramp, how long the scale-down and the nodes' release took after the load.
Goal: the autoscaled p90 within 1.5x of the fixed one's at <= 0.6x its replica-seconds. On one machine the fake
nodes share its cores, so more replicas add no compute: the ratio says what following the load costs in latency
(replicas starting while requests wait), not how much capacity it buys. Requests are of 64 tokens by default: at
128, the 2 cores are overloaded at the peak whatever the replicas, requests stay in flight for seconds after the
load falls, and the autoscaler, whose load is the contexts in flight, keeps every replica until they drain.
``--target-load`` 2 by default: this ramp holds 2-3 live contexts on one replica at its peak, so at 3 the model never
scales and at 1 it scales early and keeps its replicas longer.

``--smoke``: a short ramp, the autoscaled run only (what ``tests/cluster/placement/test_autoscaled_nodes.py`` runs);
``--json PATH``: every run's samples and requests, for a test to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx
import openai
import pinned_inferlet
import ray
from autoscaling_cluster import LocalAutoscalingCluster
from local_pie import wait_healthy
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SandboxConfig, SupervisionConfig
from pie_cluster.control.controller import LAUNCHER
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.ingress.app import serve_http, stop_http
from pie_cluster.ray_session import NAMESPACE, job_env
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table
from vllm_peer import free_port

CPUS_PER_REPLICA = 2


@dataclass(frozen=True)
class Ramp:
    """Requests per second over time: hold at base, rise to ``peak`` x base, hold, fall back, hold."""

    base_rate: float
    peak: float
    ramp_s: float
    hold_s: float

    @property
    def duration(self) -> float:
        return 3 * self.hold_s + 2 * self.ramp_s

    def rate(self, t: float) -> float:
        top = self.base_rate * self.peak
        edges = [self.hold_s, self.hold_s + self.ramp_s, 2 * self.hold_s + self.ramp_s, 2 * (self.hold_s + self.ramp_s)]
        if t < edges[0] or t >= edges[3]:
            return self.base_rate
        if t < edges[1]:
            return self.base_rate + (top - self.base_rate) * (t - edges[0]) / self.ramp_s
        if t < edges[2]:
            return top
        return top - (top - self.base_rate) * (t - edges[2]) / self.ramp_s


@dataclass
class Sample:
    t: float  # seconds since the ramp began
    rate: float
    replicas: int
    target: int
    nodes: int  # live worker nodes (the head not counted)


@dataclass
class Request:
    sent_at: float  # seconds since the ramp began
    ttft_s: float | None = None
    error: str = ""


@dataclass
class Run:
    label: str
    samples: list[Sample] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    settled_s: float | None = None  # after the ramp: until replicas and nodes were back at the minimum
    released: list[str] = field(default_factory=list)  # nodes `pie status` listed as released meanwhile
    pinned: pinned_inferlet.Pinned | None = None  # --smoke: the inferlet held on the added node (``pinned_inferlet``)

    def ttft(self, q: float) -> float:
        times = sorted(r.ttft_s for r in self.requests if r.ttft_s is not None)
        return statistics.quantiles(times, n=100, method="inclusive")[q - 1] if len(times) > 1 else math.nan

    @property
    def failed(self) -> int:
        return sum(1 for r in self.requests if r.error)

    def replica_seconds(self, until: float) -> float:
        """Replicas serving, integrated over [0, until] from the per-second samples."""
        within = [s for s in self.samples if s.t <= until]
        return sum(a.replicas * (b.t - a.t) for a, b in zip(within, within[1:], strict=False))


@contextlib.contextmanager
def autoscaled_pie(entry: ModelConfigEntry, max_nodes: int) -> Iterator[tuple[str, object, LocalAutoscalingCluster]]:
    """A Pie cluster serving ``entry`` over HTTP on a cluster of fake autoscaled nodes; yields its URL, the
    controller and the cluster."""
    node_type = {"resources": {"CPU": CPUS_PER_REPLICA, "object_store_memory": 200 * 2**20}, "node_config": {}}
    cluster = LocalAutoscalingCluster(
        head_cpus=1,
        worker_node_types={"pie.node": {**node_type, "min_workers": 0, "max_workers": max_nodes}},
        port=free_port(),
        temp_dir=tempfile.mkdtemp(prefix="ray-elastic-"),
    )
    cluster.start()
    controller = None
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env=job_env())  # fmt: skip
        config = PieConfig(
            auth=AuthConfig(enabled=False), model=[entry], sandbox=SandboxConfig(mode="off"),
            supervision=SupervisionConfig(probe_every_s=0.5),
        )  # fmt: skip
        controller = start_controller(config, detached=False)  # waits for the first replicas' nodes
        url = serve_http(config.auth, NAMESPACE, config.server.model_copy(update={"port": free_port()}))
        wait_healthy(url)
        yield url, controller, cluster
    finally:
        if controller is not None:
            with contextlib.suppress(Exception):  # a failed run still tears its cluster down
                stop_http()
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
        ray.shutdown()
        cluster.shutdown()


def replicas_now(controller, fixed: int | None) -> tuple[int, int]:
    """(replicas, target) of the one model (a fixed one's count never changes: no call to count it)."""
    if fixed is not None:
        return fixed, fixed
    (scale,) = ray.get(controller.scaling.remote())
    return scale.current, scale.target


def sample_every_second(run: Run, ramp: Ramp, controller, cluster, fixed: int | None, began: float, stop) -> None:
    while not stop.is_set():
        t = time.monotonic() - began
        replicas, target = replicas_now(controller, fixed)
        rate = ramp.rate(t) if t < ramp.duration else 0.0
        run.samples.append(Sample(t, rate, replicas, target, cluster.worker_nodes()))
        stop.wait(1.0)


async def drive(url: str, ramp: Ramp, tokens: int, run: Run, began: float) -> None:
    """Open-loop arrivals at ``ramp.rate`` for ``ramp.duration``; waits for every request to end."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=600)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", http_client=http, max_retries=0)
    arrivals = random.Random(7)

    async def one(i: int, request: Request) -> None:
        messages = [{"role": "user", "content": f"Request {i}: why do paged KV caches help batching?"}]
        sent = time.monotonic()
        try:
            chunks = await client.chat.completions.create(
                model="default", messages=messages, max_tokens=tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in chunks:
                if request.ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                    request.ttft_s = time.monotonic() - sent
        except Exception as e:  # counted, not raised: a failed request is a result
            request.error = f"{type(e).__name__}: {e}"[:300]

    pending = []
    t = 0.0
    while True:
        t += arrivals.expovariate(ramp.rate(t))
        if t >= ramp.duration:
            break
        await asyncio.sleep(max(0.0, began + t - time.monotonic()))
        request = Request(sent_at=time.monotonic() - began)
        run.requests.append(request)
        pending.append(asyncio.create_task(one(len(pending), request)))
    await asyncio.gather(*pending)
    await client.close()


def measure(label: str, entry: ModelConfigEntry, ramp: Ramp, args, console: Console) -> Run:
    fixed = None if entry.most > entry.fewest else entry.replicas
    run = Run(label)
    with autoscaled_pie(entry, args.max_replicas) as (url, controller, cluster):
        console.log(f"{label}: {replicas_now(controller, fixed)[0]} replicas serving; ramp of {ramp.duration:g} s")
        if not args.smoke:  # a few requests first, then (autoscaled) back at the minimum before the ramp
            asyncio.run(drive(url, Ramp(1.0, 1.0, 1.0, 1.0), args.tokens, Run("warm-up"), time.monotonic()))
            if fixed is None:
                settle(controller, cluster, entry, args.settle_s, Run("warm-up"))
        began, stop = time.monotonic(), threading.Event()
        sampler = threading.Thread(
            target=sample_every_second, args=(run, ramp, controller, cluster, fixed, began, stop), daemon=True
        )
        sampler.start()
        pinning = threading.Thread(target=pin_on_the_added_node, args=(run, controller), daemon=True)
        if args.smoke:
            pinning.start()
        asyncio.run(drive(url, ramp, args.tokens, run, began))
        if args.smoke:
            pinning.join(timeout=120)
        if run.pinned is not None:
            hold_the_node(run.pinned, controller, cluster, entry, args.settle_s)
        if fixed is None:  # the scale-down after the load: back to the minimum, its nodes released
            run.settled_s = settle(controller, cluster, entry, args.settle_s, run)
        stop.set()
        sampler.join()
    console.log(f"{label}: {len(run.requests)} requests, {run.failed} failed, p90 TTFT {run.ttft(90) * 1e3:.0f} ms")
    return run


def pin_on_the_added_node(run: Run, controller) -> None:
    """Once a second replica serves (and its node's host reaches it), an inferlet on that node holds a context."""
    while replicas_now(controller, None)[0] < 2:
        time.sleep(0.5)
    time.sleep(3)  # the scaler counts a replica a moment before the hosts are told of it
    node = ray.get(controller.status.remote()).replicas[1].node
    launcher = ray.get_actor(LAUNCHER)
    held = pinned_inferlet.launch(launcher, node, hold=True)
    pinned_inferlet.events_until(launcher, held, "message")
    run.pinned = pinned_inferlet.Pinned(node, instance=held)


def hold_the_node(pinned: pinned_inferlet.Pinned, controller, cluster, entry: ModelConfigEntry, timeout_s: float):
    """After the load: the replica on the pinned inferlet's node goes, the node must not while the inferlet runs;
    then it is told to finish, and the same program runs unmoved for its tokens."""
    began = time.monotonic()
    while replicas_now(controller, None)[0] > entry.fewest and time.monotonic() - began < timeout_s:
        time.sleep(0.5)
    kept = True
    for _ in range(15):  # its replica gone, the node holds on while the inferlet runs
        time.sleep(1)
        kept &= pinned.node not in ray.get(controller.status.remote()).released and cluster.worker_nodes() == 2
    launcher = ray.get_actor(LAUNCHER)
    pinned.kept_node = kept
    pinned_inferlet.tell(launcher, pinned.instance)
    pinned.result = pinned_inferlet.returned(launcher, pinned.instance)
    pinned.unmoved = pinned_inferlet.returned(launcher, pinned_inferlet.launch(launcher, None, hold=False))


def settle(controller, cluster, entry: ModelConfigEntry, timeout_s: float, run: Run) -> float | None:
    """Seconds until the model is back at ``min_replicas`` on as many nodes (None: not within ``timeout_s``),
    noting in ``run`` the nodes `pie status` lists as released meanwhile."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        replicas, _ = replicas_now(controller, None)
        run.released += [n for n in ray.get(controller.status.remote()).released if n not in run.released]
        if replicas == entry.fewest and cluster.worker_nodes() == entry.fewest:
            return time.monotonic() - began
        time.sleep(0.5)
    return None


def report(runs: list[Run], ramp: Ramp, args, console: Console) -> None:
    table = Table(title=f"Load ramp: {ramp.base_rate:g} -> {ramp.base_rate * ramp.peak:g} requests/s and back "
                  f"over {ramp.duration:g} s, {args.tokens} tokens each")  # fmt: skip
    for column in ("run", "requests", "failed", "TTFT p50 ms", "TTFT p90 ms", "replica-s", "max replicas",
                   "settled after load s"):  # fmt: skip
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            run.label, str(len(run.requests)), str(run.failed), f"{run.ttft(50) * 1e3:.0f}",
            f"{run.ttft(90) * 1e3:.0f}",
            f"{run.replica_seconds(ramp.duration):.0f}", str(max((s.replicas for s in run.samples), default=0)),
            "-" if run.settled_s is None else f"{run.settled_s:.1f}",
        )  # fmt: skip
    console.print(table)
    notes = []
    if len(runs) == 2:
        auto, fixed = runs
        notes.append(
            f"autoscaled / fixed: TTFT p90 {auto.ttft(90) / fixed.ttft(90):.2f}x (goal <= 1.5x), replica-seconds "
            f"{auto.replica_seconds(ramp.duration) / fixed.replica_seconds(ramp.duration):.2f}x (goal <= 0.6x)"
        )
        console.print(notes[-1])
    write_markdown(args.out, "elastic", [table, *notes])
    if args.out:
        plot(runs, ramp, os.path.join(args.out, "elastic.png"))


def plot(runs: list[Run], ramp: Ramp, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, rate_axis = plt.subplots(figsize=(8, 4))
    times = [i / 2 for i in range(int(ramp.duration * 2))]
    rate_axis.plot(times, [ramp.rate(t) for t in times], color="grey", label="offered requests/s")
    rate_axis.set_xlabel("seconds")
    rate_axis.set_ylabel("requests/s")
    replica_axis = rate_axis.twinx()
    for run in runs:
        replica_axis.step([s.t for s in run.samples], [s.replicas for s in run.samples], where="post",
                          label=f"{run.label}: replicas")  # fmt: skip
    replica_axis.set_ylabel("replicas serving")
    replica_axis.set_ylim(0, max(s.replicas for run in runs for s in run.samples) + 1)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-rate", type=float, default=0.5)
    ap.add_argument("--peak", type=float, default=8.0)
    ap.add_argument("--ramp-s", type=float, default=60.0)
    ap.add_argument("--hold-s", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-replicas", type=int, default=3)
    ap.add_argument("--target-load", type=float, default=2.0)
    ap.add_argument("--upscale-delay-s", type=float, default=3.0)
    ap.add_argument("--downscale-delay-s", type=float, default=10.0)
    ap.add_argument("--settle-s", type=float, default=180.0, help="how long to wait for the scale-down after")
    ap.add_argument("--smoke", action="store_true", help="a short ramp, the autoscaled run only")
    ap.add_argument("--json", default="", help="write every run's samples and requests here")
    add_out_option(ap)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console()
    if args.smoke:  # short, and quick to follow: the test wants the changes, not their smoothing
        args.ramp_s, args.hold_s, args.max_replicas, args.base_rate, args.tokens = 10.0, 8.0, 2, 1.0, 64
        args.upscale_delay_s, args.downscale_delay_s, args.target_load = 0.0, 5.0, 2.0
    ramp = Ramp(args.base_rate, args.peak, args.ramp_s, args.hold_s)
    common = {"pages": 512, "cpus_per_rank": CPUS_PER_REPLICA, "target_load": args.target_load}
    autoscaled = ModelConfigEntry(
        **common, min_replicas=1, max_replicas=args.max_replicas, upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s,
    )  # fmt: skip
    runs = [measure("autoscaled", autoscaled, ramp, args, console)]
    if not args.smoke:
        runs.append(measure("fixed", ModelConfigEntry(**common, replicas=args.max_replicas), ramp, args, console))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(run) for run in runs], f)
    if not args.smoke:
        report(runs, ramp, args, console)


if __name__ == "__main__":
    main()
