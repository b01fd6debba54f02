"""How long a worker has waited for a CPU: time it was ready to run and did not.

On a loaded machine a worker's event loop can be ready and unscheduled for seconds. That is neither a stall of its
own (``watchdog.py``) nor silence toward the host (``pool.py``), and both deadlines leave it out. The kernel counts
it per thread (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a CPU, nanoseconds waiting on a run queue, time
slices), but adds a wait only once it ends, when the thread runs again: a thread that is runnable (state ``R``)
and has not run since the last look is waiting right now, and a deadline past due waits for it to run and be
counted. Where the kernel keeps no such statistics, waits read 0 and the deadlines count wall time.

A worker's own threads make it wait too (a busy loop in several threads), so the excuse is bounded: past
``WALL_BOUND_STALLS`` times ``stall_s`` in wall time (five times the host's ping deadline), the worker is ended
however long it waited.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

WALL_BOUND_STALLS = 30


@dataclass(frozen=True)
class _Thread:
    ran_s: float  # on a CPU, so far
    waited_s: float  # waiting for one, so far (waits that have ended)
    runnable: bool


class WaitClock:
    """What process ``pid`` waited for a CPU between two looks: the longest wait of any one of its threads, since
    the loop's thread may be waiting, not for a CPU, but for the interpreter lock that a waiting thread holds. (The
    longest, not the sum: many threads of a busy loop waiting at once excuse no more time than passed.)"""

    def __init__(self, pid: int):
        self.pid = pid
        self._seen = self._threads()
        self.waiting = False  # at the last look: one of its threads is runnable and has not run since the one before

    def since_last_look(self) -> float:
        threads = self._threads()
        longest, self.waiting = 0.0, False
        for tid, now in threads.items():
            before = self._seen.get(tid, now)
            longest = max(longest, now.waited_s - before.waited_s)
            self.waiting |= now.runnable and now.ran_s == before.ran_s
        self._seen = threads
        return longest

    def _threads(self) -> dict[int, _Thread]:
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return {}
        threads = {}
        for tid in tids:
            try:
                ran, waited = Path(f"/proc/{self.pid}/task/{tid}/schedstat").read_text().split()[:2]
                state = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, ValueError, IndexError):  # it ended, or no scheduler statistics in this kernel
                continue
            threads[int(tid)] = _Thread(int(ran) / 1e9, int(waited) / 1e9, state == "R")
        return threads


def worker_process(bwrap_pid: int) -> int | None:
    """The Python process bubblewrap ``bwrap_pid`` runs (bubblewrap forks a namespace init that forks it): its
    first descendant, breadth first, that is not bubblewrap; None while it has not exec'd yet."""
    bwrap = _comm(bwrap_pid)
    todo = [bwrap_pid]
    while todo:
        for child in _children(todo.pop(0)):
            if _comm(child) != bwrap:
                return child
            todo.append(child)
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
