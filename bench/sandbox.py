"""What the sandbox costs: launch latency and memory, sandboxed workers vs inferlets in the trusted host.

Usage: python bench/sandbox.py [--launches 40] [--parked 100] [--rounds 2] [--out docs/bench]

Each round starts a Pie cluster on this machine twice — ``[sandbox] mode = "off"`` (uploaded programs run as asyncio
tasks in the node's trusted host: the baseline) and ``"bubblewrap"`` (they run in the user's sandboxed worker) —
and measures on each, in the same run:

(a) launch latency: HTTP launch (``POST /v1/instances?stream=true``) -> the first event of ``return "ok"``, N
    sequential launches after a warm-up, so the user's worker is already running (pooled, as launches are);
(b) memory per parked inferlet: K instances waiting in ``session.receive()``, the RSS of the process they share
    (the host, or the user's worker) before and after, over K; and, sandboxed, the RSS/USS of an idle worker (the
    spare each host keeps ready).

Goal (issue 24): a pooled sandboxed launch -> first event p50 within 1.5x of the in-host launch.
The tables go to ``OUT/sandbox.md`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
from local_pie import local_pie
from pie_cluster.client import PieClient
from pie_cluster.launch_request import LaunchRequest
from report import add_out_option, write_markdown
from rich.console import Console
from rich.table import Table

GOAL_RATIO = 1.5
MODES = ("off", "bubblewrap")
TRIVIAL = 'async def main(input):\n    return "ok"\n'
PARKED = """
import os
from inferlet import session

async def main(input):
    session.send(str(os.getpid()))
    return await session.receive()
"""


def first_event_ms(client: PieClient, program: str) -> float:
    start = time.perf_counter()
    first = None
    for _, kind, _ in client.launch_and_follow(LaunchRequest(program=program)):
        if first is None and kind != "launched":
            first = (time.perf_counter() - start) * 1e3
    return first


def upload(client: PieClient, tmp: Path, name: str, source: str) -> str:
    path = tmp / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return client.upload(path)["program"]


def worker_pids() -> set[int]:
    """The sandboxed worker processes on this machine (inside bwrap, the Python that runs worker_main)."""
    pids = set()
    for p in psutil.process_iter(["cmdline", "name"]):
        cmdline = p.info["cmdline"] or []
        if "pie_cluster.hosts.sandbox.worker_main" in cmdline and p.info["name"] != "bwrap":
            pids.add(p.pid)
    return pids


def memory(pid: int) -> tuple[float, float]:
    """(RSS, USS) in MiB, the median of a few samples (a heap breathes)."""
    samples = []
    for _ in range(5):
        info = psutil.Process(pid).memory_full_info()
        samples.append((info.rss / 2**20, info.uss / 2**20))
        time.sleep(0.1)
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def parked_memory(client: PieClient, tmp: Path, mode: str, k: int) -> dict:
    """RSS of the process K parked inferlets share, before and after; their instances are then released."""
    program = upload(client, tmp, "parked", PARKED)
    warm = client.launch(LaunchRequest(program=program))
    pid_seen = int(next(client.events(warm))[2])
    client.send(warm, "bye")
    list(client.events(warm))
    time.sleep(1.0)  # the host's next spare worker is starting
    # the process they share: the host (no PID namespace: its own pid), or whichever worker grows (the user's)
    candidates = {pid_seen} if mode == "off" else worker_pids()
    before = {pid: memory(pid) for pid in candidates}
    ids = [client.launch(LaunchRequest(program=program)) for _ in range(k)]
    for instance in ids:
        next(client.events(instance))
    after = {pid: memory(pid) for pid in candidates}
    shared = max(candidates, key=lambda pid: after[pid][0] - before[pid][0])
    spare = min(candidates - {shared}, default=None)
    for instance in ids:
        client.send(instance, "bye")
    for instance in ids:
        list(client.events(instance))
    return {
        "before": before[shared],
        "after": after[shared],
        "per_kib": [(a - b) * 1024 / k for a, b in zip(after[shared], before[shared], strict=True)],
        "spare": before[spare] if spare is not None else None,
    }


def measure(mode: str, args, tmp: Path, console: Console) -> dict:
    with local_pie(pages=256, cpus_per_rank=1, sandbox=mode) as pie:
        client = PieClient(pie.url)
        try:
            program = upload(client, tmp, "trivial", TRIVIAL)
            for _ in range(5):
                first_event_ms(client, program)
            launches = [first_event_ms(client, program) for _ in range(args.launches)]
            console.log(f"{mode}: launch p50 {statistics.median(launches):.1f} ms")
            parked = parked_memory(client, tmp, mode, args.parked)
        finally:
            client.close()
    return {"launches": launches, "parked": parked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--parked", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    add_out_option(ap)
    args = ap.parse_args()
    console = Console(width=120)
    tmp = Path(tempfile.mkdtemp(prefix="pie-bench-sandbox-"))
    runs = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(measure(mode, args, tmp, console))

    report = []

    def show(part) -> None:
        console.print(part)
        report.append(part)

    launches = {mode: [x for r in runs[mode] for x in r["launches"]] for mode in MODES}
    p50 = {mode: statistics.median(launches[mode]) for mode in MODES}
    table = Table(title=f"(a) launch -> first event, ms ({args.rounds} rounds x {args.launches} launches per mode)")
    for col in ("where user code runs", "p50", "p90", "min"):
        table.add_column(col, justify="right")
    for mode, label in zip(MODES, ("trusted host (sandbox off)", "sandboxed worker"), strict=True):
        values = sorted(launches[mode])
        table.add_row(label, f"{p50[mode]:.1f}", f"{values[int(0.9 * len(values))]:.1f}", f"{values[0]:.1f}")
    show(table)
    ratio = p50["bubblewrap"] / p50["off"]
    verdict = "met" if ratio <= GOAL_RATIO else "MISSED"
    show(f"sandboxed / in-host p50: {ratio:.2f}x (goal <= {GOAL_RATIO:g}x: {verdict})")

    table = Table(title=f"(b) memory, MiB: {args.parked} inferlets parked in session.receive() (last round)")
    for col in ("shared process", "RSS before", "RSS with them", "per parked inferlet", "idle worker RSS / USS"):
        table.add_column(col, justify="right")
    for mode, label in zip(MODES, ("trusted host", "user's worker"), strict=True):
        parked = runs[mode][-1]["parked"]
        spare = parked["spare"]
        table.add_row(
            label,
            f"{parked['before'][0]:.1f}",
            f"{parked['after'][0]:.1f}",
            f"{parked['per_kib'][0]:.0f} KiB",
            f"{spare[0]:.1f} / {spare[1]:.1f}" if spare else "-",
        )
    show(table)
    write_markdown(args.out, "sandbox", report)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
