"""Inside a worker: end the process when one task step holds the event loop too long (a busy loop, a blocking call).

What stalls a worker is one step of one task that does not yield, not a loop with much to do: a thousand inferlets
starting at once make long loop turns out of short steps, and must not be mistaken for a stall. So every task the
worker's loop makes runs its coroutine through ``_Timed``, which notes when the current step began, and a thread
checks that note: a step older than ``stall_s``, less the time the loop waited for a CPU (``cpu_wait.py``), ends
the process with ``STALLED``, which the host reports to the user's instances. (User code could defeat this thread,
but only within its own worker; the host's ping, with a longer deadline, stays the backstop.) A blocking SDK call
that waits for the cluster rather than the user's code (a replica's replacement, which takes as long as loading the
model) is excused while it waits (``waiting_on_the_cluster``, installed as ``inferlet.runtime.blocking_wait``).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import os
import threading
import time
from collections.abc import Callable

from pie_cluster.hosts.sandbox import cpu_wait

STALLED = 86  # the worker's exit status when a step held its loop past ``stall_s``

_step_began = 0.0  # when the running task step began (time.monotonic()); 0.0 between steps
_excused = 0  # blocking waits on the cluster under way (see waiting_on_the_cluster)
_tell_host: Callable[[bool], None] = lambda waiting: None  # noqa: E731  (set by install)


class _Timed(collections.abc.Coroutine):
    """A coroutine that notes when each of its steps begins and ends."""

    __slots__ = ("_coro",)

    def __init__(self, coro):
        self._coro = coro

    def send(self, value):
        global _step_began
        _step_began = time.monotonic()
        try:
            return self._coro.send(value)
        finally:
            _step_began = 0.0

    def throw(self, *exc):
        global _step_began
        _step_began = time.monotonic()
        try:
            return self._coro.throw(*exc)
        finally:
            _step_began = 0.0

    def close(self):
        return self._coro.close()

    def __await__(self):
        return self._coro.__await__()


@contextlib.contextmanager
def waiting_on_the_cluster():
    """The running step blocks on the cluster, not on user code: no stall while it waits (the host is told, since
    its pings go unanswered meanwhile), and the rest of the step is timed from when the wait ends."""
    global _excused, _step_began
    _excused += 1
    if _excused == 1:
        _tell_host(True)
    try:
        yield
    finally:  # the step's new start before the excuse ends: ``_watch`` reads them in the other order
        if _step_began:
            _step_began = time.monotonic()
        _excused -= 1
        if not _excused:
            _tell_host(False)


def install(loop: asyncio.AbstractEventLoop, stall_s: float, tell_host: Callable[[bool], None]) -> None:
    """Time every task ``loop`` makes from now on, and watch the steps from a daemon thread. ``tell_host``: says
    at once whether the loop is blocked on the cluster (``["waiting", bool]``)."""
    global _tell_host
    _tell_host = tell_host
    loop.set_task_factory(lambda loop, coro, **kw: asyncio.Task(_Timed(coro), loop=loop, **kw))
    threading.Thread(target=_watch, args=(stall_s,), name="stall-watchdog", daemon=True).start()


def _watch(stall_s: float) -> None:
    """A step's time is its wall time less what the worker waited for a CPU meanwhile (``cpu_wait.py``), counted
    from this thread's last look before the step began; one past due while a thread waits for a CPU waits for it,
    up to ``WALL_BOUND_STALLS`` times ``stall_s``."""
    seen, excused_s, waits = 0.0, 0.0, cpu_wait.WaitClock(os.getpid())
    while True:
        time.sleep(min(1.0, stall_s / 4))
        waited = waits.since_last_look()  # (reading /proc lets the loop's thread run meanwhile)
        excused, began = _excused, _step_began  # this order: a wait that has ended has restarted its step's clock
        excused_s = (excused_s if began == seen else 0.0) + waited
        seen = began
        held_s = time.monotonic() - began
        past_due = held_s - excused_s > stall_s and not waits.waiting or held_s > cpu_wait.WALL_BOUND_STALLS * stall_s
        if began and not excused and past_due:
            os.write(2, f"one task step held the worker's event loop for more than {stall_s:g} s\n".encode())
            os._exit(STALLED)
