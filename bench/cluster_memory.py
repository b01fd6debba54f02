"""(a) of bench/cluster.py: memory per idle pooled inferlet.

K instances pinned to one node, each parked in ``await session.receive()`` (it has sent its pid first, so we know it
got there); RSS and USS of that node's pooled host process before and after, over K. Then every one is aborted and
must end, and the launcher's running count must return to where it was.
"""

from __future__ import annotations

import statistics
import time

import psutil
import ray
from cluster_inferlets import DEADLINE_S, USER, run_to_end, upload
from pie_cluster.launch_request import LaunchRequest
from rich.console import Console

IDLE = """
import os
from inferlet import session

async def main(input):
    session.send(str(os.getpid()))
    return await session.receive()
"""


def wait_for_message(launcher, ids: list[str], timeout: float = DEADLINE_S) -> dict[str, str]:
    """The first ``message`` event of each instance (each idle inferlet sends its pid before it parks)."""
    got: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids) - len(got)} idle inferlets never reached session.receive()")
        pending = [i for i in ids if i not in got]
        placed = ray.get([launcher.locate.remote(USER, i, 10.0) for i in pending])  # where each one's events are
        hosts = {i: where.host for i, where in zip(pending, placed, strict=True)}
        waiting = [i for i in pending if hosts[i] is not None]
        batches = ray.get([hosts[i].events.remote(USER, i, 0, 10.0) for i in waiting])
        for instance_id, batch in zip(waiting, batches, strict=True):
            for _, kind, value in batch.events:
                if kind == "message":
                    got[instance_id] = value
                    break
                if kind in ("return", "error"):
                    raise RuntimeError(f"idle instance {instance_id} ended: {kind} {value}")
    return got


def rss(pid: int) -> tuple[int, int]:
    """(RSS, USS) of a process in bytes; sampled a few times, the median, since the host's heap breathes."""
    process = psutil.Process(pid)
    samples = []
    for _ in range(5):
        info = process.memory_full_info()
        samples.append((info.rss, info.uss))
        time.sleep(0.1)
    return int(statistics.median(s[0] for s in samples)), int(statistics.median(s[1] for s in samples))


def idle_memory(launcher, node: str, k: int, console: Console) -> dict:
    program = upload(launcher, IDLE, name="idle")
    # warm-up: the first instance on a host imports the session machinery; keep that out of the per-instance cost
    request = LaunchRequest(program=program, deadline_s=DEADLINE_S, node_id=node)
    warm = ray.get(launcher.launch.remote(USER, request))
    pid = int(wait_for_message(launcher, [warm])[warm])
    ray.get(launcher.abort.remote(USER, warm))
    run_to_end(launcher, USER, warm)
    time.sleep(0.5)
    running_before = ray.get(launcher.stats.remote()).running
    before = rss(pid)

    ids = ray.get([launcher.launch.remote(USER, request) for _ in range(k)])
    pids = wait_for_message(launcher, ids)
    if {int(p) for p in pids.values()} != {pid}:
        raise RuntimeError(f"idle inferlets ran in processes {set(pids.values())}, not the pooled host {pid}")
    time.sleep(0.5)
    after = rss(pid)
    console.log(f"(a) {k} idle inferlets parked in pooled host pid {pid}; aborting them")

    aborted = ray.get([launcher.abort.remote(USER, i) for i in ids])
    ends = [run_to_end(launcher, USER, i) for i in ids]
    ended_by_abort = sum(1 for kind, value in ends if kind == "error" and "aborted" in value)
    time.sleep(0.5)
    released = rss(pid)
    running_after = ray.get(launcher.stats.remote()).running
    return {
        "k": k,
        "pid": pid,
        "before": before,
        "after": after,
        "released": released,
        "aborted": sum(aborted),
        "ended": ended_by_abort,
        "running_before": running_before,
        "running_after": running_after,
    }
