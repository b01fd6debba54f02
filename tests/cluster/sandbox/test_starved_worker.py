"""A worker starved of CPU by the machine's other work is neither stalled nor silent.

On a loaded host a worker's event loop can be ready and unscheduled for seconds. The time it waited for a CPU
(``cpu_wait.py``) counts neither toward its own stall deadline nor toward the host's ping deadline.

Here the worker gets little CPU: it is pinned to one CPU beside a busy real-time process, which leaves the CPU's
ordinary processes a twentieth of its time (the kernel's real-time throttling). With deadlines of 0.5 s and 6 x
0.5 s, it runs steps of 0.2 CPU-seconds until one has waited past both (a step takes at least 4 s there), and must
still finish. A busy loop there, which waits for the CPU as much, is still ended: the excuse is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox import cpu_wait
from pie_cluster.hosts.sandbox.pool import UNANSWERED_STALLS
from support.worker_pool import launch, run

STALL_S = 0.5
# a real-time busy process takes one CPU for seconds: other modules' deadlines would pay for it
pytestmark = pytest.mark.alone

STEPS = """
import asyncio, time
from pathlib import Path
from inferlet import session

def waited_s():
    return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e9

async def main(input):
    await session.receive()  # once the test has starved this worker
    steps, longest = 0, 0.0
    while longest < input["wait_s"] and steps < 20:
        began, end = waited_s(), time.thread_time() + 0.2
        while time.thread_time() < end:  # one step of this much CPU time
            pass
        steps, longest = steps + 1, max(longest, waited_s() - began)
        await asyncio.sleep(0)
    return {"steps": steps, "longest_wait_s": longest}
"""
BUSY = """
import os, time
os.sched_setaffinity(0, {0})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
print("busy", flush=True)
end = time.monotonic() + 60  # should the test die without ending it
while time.monotonic() < end:
    pass
"""


def _workers() -> list[int]:
    """The sandboxed worker processes under this test's process."""
    found, todo = [], [os.getpid()]
    while todo:
        parent = todo.pop()
        try:
            for task in Path(f"/proc/{parent}/task").iterdir():
                children = [int(c) for c in (task / "children").read_text().split()]
                todo += children
                found += [python] if (python := cpu_wait.worker_process(parent)) in children else []
        except OSError:  # it exited meanwhile
            continue
    return found


def _pin_to_cpu0(pid: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {0})


@contextlib.asynccontextmanager
async def starved(host, instance: str):
    """Once ``instance``'s worker is up and asks for its message: a real-time busy process on CPU 0, every worker
    under this process pinned there, and then the message ("go"). Yields a ``WaitClock`` of each worker."""
    if not Path(f"/proc/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no scheduler statistics: waits for a CPU cannot be told apart")
    for _ in range(1200):  # until its worker is up and asks for the message (or ended)
        if instance in host.inbox or instance in host.ended:
            break
        await asyncio.sleep(0.05)
    assert instance in host.inbox, host.events
    busy = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if busy.stdout.readline() != "busy\n":
            pytest.skip(f"no real-time process may be started here: {busy.communicate()[1].strip()[-200:]}")
        workers = _workers()
        assert workers, "no sandboxed worker found under this process"
        for pid in workers:
            _pin_to_cpu0(pid)
        clocks = [cpu_wait.WaitClock(pid) for pid in workers]
        host.inbox[instance].put_nowait("go")
        yield clocks
    finally:
        busy.kill()
        busy.wait()


def test_a_worker_waiting_for_a_cpu_past_both_deadlines_finishes():
    deadline_s = UNANSWERED_STALLS * STALL_S

    async def test(pool, host, view):
        await launch(pool, "alice", "a1", STEPS, {"wait_s": deadline_s + 0.2})
        async with starved(host, "a1") as clocks:
            kind, result = await host.outcome("a1", timeout=240)
            waited = max(clock.since_last_look() for clock in clocks)
        assert kind == "return", result
        result = json.loads(result)
        # one step of 0.2 CPU-seconds waited past the host's whole ping deadline: counted in wall time, it was past
        # the worker's own stall deadline, and its silence (no pong while a step runs) past the host's
        assert result["longest_wait_s"] > deadline_s, result
        assert waited >= result["longest_wait_s"], (waited, result)  # (read from outside as well)

    run(test, SandboxConfig(stall_s=STALL_S, cgroups=False))


SPINS = """
from inferlet import session

async def main(input):
    await session.receive()
    while True:  # never yields
        pass
"""


def test_a_starved_busy_loop_is_still_ended():
    """Its loop waits for the CPU as much as a legitimate step does, yet it is ended: by the CPU time it did get
    past ``stall_s``, or at ``WALL_BOUND_STALLS`` times ``stall_s`` in wall time, whichever comes first."""

    async def test(pool, host, view):
        await launch(pool, "alice", "a1", SPINS)
        async with starved(host, "a1"):
            kind, message = await host.outcome("a1", timeout=120)
        # by its own watchdog or by the host's ping, whichever reaches the bound first (its watchdog thread waits for
        # the CPU, and for the interpreter lock the loop holds)
        ended = (f"held the worker's event loop for more than {STALL_S:g} s", "it answered nothing for")
        assert kind == "error" and any(why in message for why in ended), message

    run(test, SandboxConfig(stall_s=STALL_S, cgroups=False))
