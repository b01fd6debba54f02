"""An instance's event stream and inbox, held where the instance runs, and how clients follow it.

Kinds follow Pie's client protocol: ``stdout``, ``stderr``, ``message``, ``file`` (bytes), and the terminal
``return`` and ``error``. Events are numbered from 0; a client reads "everything from index i on" and resumes
from the index it got back. The buffer keeps the newest ``capacity`` events (oldest dropped, like Pie's 4096-entry
ring), but the terminal event is never dropped, so a late client always learns how the instance ended.

Events never pass through a cluster-wide actor: the node host that runs an instance (or the ingress, for the
cluster's own programs) keeps its ``Channel``, and ``follow`` asks the launcher once where that is, then reads the
events from there. The launcher only learns how each instance ended.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import ray.exceptions
from pie_workers.deadlines import LAUNCHER_S, NoAnswer, answer

from pie_cluster.config import ChannelLimits

KINDS = ("stdout", "stderr", "message", "file", "return", "error")
TERMINAL = ("return", "error")


class NotFound(LookupError):
    """No such instance or program for this user (another user's answers the same, so ids cannot be probed)."""


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

    async def finished(self) -> Event:
        """The terminal event, once there is one."""
        while self.terminal is None:
            self._changed.clear()
            await self._changed.wait()
        return self.terminal

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


@dataclass
class Channel:
    """One instance's events out and its client's messages and files in, kept by whatever runs it."""

    user: str
    log: EventLog
    started: float | None = None  # when its program's main began (``time.perf_counter``), where that is measured
    first_pass: float | None = None  # when a pass first generated for it (the prefill's answer), measured there too
    inbox: dict[str, asyncio.Queue] = field(
        default_factory=lambda: {"message": asyncio.Queue(), "file": asyncio.Queue()}
    )
    waiting: set[asyncio.Future] = field(default_factory=set)
    launch: dict | None = None  # what a restarted launcher learns of it from its host (``InferletHost.live``)

    def events(self, got: list[Event], since: int) -> dict:
        """The answer to a poll: the events, where to resume, and whether the terminal one is among them."""
        return {
            "events": [e.as_wire() for e in got],
            "next": got[-1].index + 1 if got else max(since, 0),
            "done": self.log.done and (not got or got[-1] is self.log.terminal),
        }

    def put(self, kind: str, value: str | bytes) -> None:
        if self.log.done:
            raise ValueError("the instance has ended; it can no longer receive")
        self.inbox[kind].put_nowait(value)

    async def receive(self, kind: str):
        """What the client sends next (the instance's ``inferlet.session``); cancelled when the instance ends."""
        if self.log.done:
            raise RuntimeError("the instance has ended")
        waiter = asyncio.ensure_future(self.inbox[kind].get())
        self.waiting.add(waiter)
        try:
            return await waiter
        finally:
            self.waiting.discard(waiter)


class Channels:
    """The channels of the instances one process runs; ended ones stay readable until ``keep`` newer ones ended.
    Events are batched per event-loop turn (``emit``), and the endings of a turn go to ``ended`` in one call (the
    launcher's, which learns nothing else of an instance's events)."""

    def __init__(self, limits: ChannelLimits, ended: Callable[[list[tuple[str, str, str | bytes]]], object]):
        self._capacity, self._keep = limits.event_buffer, limits.keep_finished
        self._open: dict[str, Channel] = {}
        self._ended: OrderedDict[str, Channel] = OrderedDict()
        self._report_endings = ended
        self._outbox: list[tuple[str, str, str | bytes]] = []

    def emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        """Queue an event for this loop turn's batch; consecutive writes to one stream merge into one event."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        elif kind in ("stdout", "stderr") and self._outbox[-1][:2] == (instance_id, kind):
            self._outbox[-1] = (instance_id, kind, self._outbox[-1][2] + value)
            return
        self._outbox.append((instance_id, kind, value))

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        endings = [(i, e.kind, e.value) for i, kind, value in batch if (e := self.append(i, kind, value))]
        if endings:
            self._report_endings(endings)

    def open(self, instance_id: str, user: str) -> Channel:
        channel = self._open[instance_id] = Channel(user, EventLog(self._capacity))
        return channel

    def discard(self, instance_id: str) -> None:
        """Forget an open channel and the events queued for it, reporting no ending (its instance was begun early
        and undone: the launcher never ran it as this)."""
        channel = self._open.pop(instance_id, None)
        self._outbox = [event for event in self._outbox if event[0] != instance_id]
        for waiter in list(channel.waiting) if channel is not None else ():
            waiter.cancel()

    def find(self, instance_id: str) -> Channel | None:
        return self._open.get(instance_id) or self._ended.get(instance_id)

    def all(self) -> list[Channel]:
        """The running instances' channels, then the kept ended ones', oldest first."""
        return [*self._open.values(), *self._ended.values()]

    def own(self, user: str, instance_id: str) -> Channel:
        channel = self.find(instance_id)
        if channel is None or channel.user != user:
            raise NotFound(f"no instance {instance_id!r}")
        return channel

    def append(self, instance_id: str, kind: str, value: str | bytes) -> Event | None:
        """Add an event; returns it when it was the instance's terminal one (the channel is then closed)."""
        channel = self._open.get(instance_id)
        if channel is None:
            return None
        channel.log.append(kind, value)
        if not channel.log.done:
            return None
        del self._open[instance_id]
        for waiter in list(channel.waiting):
            waiter.cancel()
        self._ended[instance_id] = channel
        while len(self._ended) > self._keep:
            self._ended.popitem(last=False)
        return channel.log.terminal


async def follow(
    launcher,
    user: str,
    instance: str,
    since: int = 0,
    *,
    wait: float = 30.0,
    abort_on_close: bool = False,
    where: dict | None = None,
    channel: Channel | None = None,
) -> AsyncIterator[list[list]]:
    """An instance's events from ``since`` to the terminal one, each batch as ``[index, kind, value]`` lists (an
    empty batch when ``wait`` seconds passed without one). The launcher is asked once where the instance runs
    (``where``: already asked), and again only if that place stops answering; the events come from there.
    ``channel``: the instance runs in this process. With ``abort_on_close``, closing this before the terminal event
    (the client went away) aborts the instance, which frees everything it holds."""
    ended = False
    try:
        if channel is not None:
            while not ended:
                polled = channel.events(await channel.log.wait(since, wait), since)
                ended, since = polled["done"], polled["next"]
                yield polled["events"]
            return
        where = where or await locate(launcher, user, instance, wait)
        while not ended:
            polled = await _poll(where["host"], user, instance, since, wait)
            if polled is not None:
                ended, since = polled["done"], polled["next"]
                yield polled["events"]
            elif where["ending"] is not None:  # its host is gone or forgot it: the launcher knows how it ended
                ended = True
                yield [[since, *where["ending"]]]
            else:  # queued, or its host just died and the launcher has not yet noticed
                if where["host"] is not None:
                    await asyncio.sleep(0.5)
                where = await locate(launcher, user, instance, wait)
                if where["host"] is None and where["ending"] is None:
                    yield []
    finally:
        if abort_on_close and not ended:
            launcher.abort.remote(user, instance)


async def locate(launcher, user: str, instance: str, wait: float = 0.0) -> dict:
    """Where the instance runs (``host``: the actor that keeps its channel, None while it is queued) and how it ended,
    once the launcher knows (``ending``: ``[kind, value]``); waits up to ``wait`` s for a queued one to start.
    Raises ``NotFound`` (inside Ray's ``RayTaskError``) for another user's or an unknown id."""
    return await answer(launcher.locate.remote(user, instance, wait), "the launcher", wait + LAUNCHER_S)


async def _poll(host, user: str, instance: str, since: int, wait: float) -> dict | None:
    """One long poll of the host's channel; None if there is no host, or it is dead, hung, or no longer knows it."""
    if host is None:
        return None
    try:
        return await answer(host.events.remote(user, instance, since, wait), "the inferlet host", wait + LAUNCHER_S)
    except (ray.exceptions.RayError, NoAnswer):
        return None


# -- blocking forms, for scripts and tests that drive a cluster from a driver ------------------------------------------


def poll(launcher, user: str, instance: str, since: int = 0, wait: float = 10.0) -> dict:
    """One read of the instance's events from where it runs: ``{"events", "next", "done"}`` as a host answers. If
    its host died or hangs, this waits (up to ``wait`` s beyond a call's deadline) for the launcher to learn how the
    instance ended."""
    deadline = time.monotonic() + wait + LAUNCHER_S
    while True:
        where = ray.get(launcher.locate.remote(user, instance, wait), timeout=wait + LAUNCHER_S)
        if where["host"] is not None:
            try:
                return ray.get(where["host"].events.remote(user, instance, since, wait), timeout=wait + LAUNCHER_S)
            except ray.exceptions.RayError:
                if where["ending"] is None and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                if where["ending"] is None:
                    raise
        if where["ending"] is not None:
            return {"events": [[since, *where["ending"]]], "next": since + 1, "done": True}
        return {"events": [], "next": since, "done": False}


def deliver(launcher, user: str, instance: str, value: str | bytes) -> None:
    """Send the instance a session message (a ``str``) or file (``bytes``), into its inbox where it runs."""
    where = ray.get(launcher.locate.remote(user, instance, LAUNCHER_S), timeout=2 * LAUNCHER_S)
    if where["host"] is None:
        raise RuntimeError(f"instance {instance} is not running")
    kind = "file" if isinstance(value, bytes) else "message"
    ray.get(where["host"].send.remote(user, instance, kind, value), timeout=LAUNCHER_S)
