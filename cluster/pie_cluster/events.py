"""An instance's event stream: what the inferlet printed, sent and returned, buffered for clients that attach late.

Kinds follow Pie's client protocol: ``stdout``, ``stderr``, ``message``, ``file`` (bytes), and the terminal
``return`` and ``error``. Events are numbered from 0; a client reads "everything from index i on" and resumes
from the index it got back. The buffer keeps the newest ``capacity`` events (oldest dropped, like Pie's 4096-entry
ring), but the terminal event is never dropped, so a late client always learns how the instance ended.
``follow`` is the long-poll loop of every client that reads them through the launcher actor.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pie_workers.deadlines import LAUNCHER_S, answer

KINDS = ("stdout", "stderr", "message", "file", "return", "error")
TERMINAL = ("return", "error")


@dataclass(frozen=True)
class Event:
    index: int
    kind: str
    value: str | bytes

    def as_wire(self) -> list:
        return [self.index, self.kind, self.value]


class EventLog:
    def __init__(self, capacity: int = 4096):
        self._events: deque[Event] = deque(maxlen=capacity)
        self._next = 0
        self._changed = asyncio.Event()
        self.terminal: Event | None = None

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def append(self, kind: str, value: str | bytes) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        if self.done:
            return  # nothing follows a return or error
        event = Event(self._next, kind, value)
        self._next += 1
        self._events.append(event)
        if kind in TERMINAL:
            self.terminal = event
        self._changed.set()

    def since(self, index: int) -> list[Event]:
        """Buffered events numbered ``index`` or later, plus the terminal event even if it rotated out."""
        got = [e for e in self._events if e.index >= index]
        if self.terminal is not None and self.terminal.index >= index and (not got or got[-1] is not self.terminal):
            got.append(self.terminal)
        return got

    async def wait(self, index: int, timeout: float) -> list[Event]:
        """Events from ``index`` on, waiting up to ``timeout`` seconds for the first one (long poll)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.since(index) and not self.done:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                break
        return self.since(index)  # read after the wait: events may arrive while a timed-out wait is cancelled


async def follow(
    launcher,
    user: str,
    instance: str,
    since: int = 0,
    *,
    wait: float = 30.0,
    first: dict | None = None,
    abort_on_close: bool = False,
) -> AsyncIterator[list[list]]:
    """An instance's events, one long poll of the launcher's ``events`` at a time, from ``since`` to the terminal
    event: each batch as ``[index, kind, value]`` lists, an empty one when a poll waited ``wait`` seconds in vain.
    ``first`` is a batch already fetched. With ``abort_on_close``, closing this before the terminal event (the
    client went away) aborts the instance, which frees everything it holds."""
    batch, ended = first, False
    try:
        while True:
            if batch is None:
                polled = launcher.events.remote(user, instance, since, wait)
                batch = await answer(polled, "the launcher", wait + LAUNCHER_S)
            ended = batch["done"]
            yield batch["events"]
            if ended:
                return
            since, batch = batch["next"], None
    finally:
        if abort_on_close and not ended:
            launcher.abort.remote(user, instance)
