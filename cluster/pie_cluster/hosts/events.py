"""An instance's event stream and inbox, held where the instance runs, and how clients follow it.

Kinds follow Pie's client protocol: ``stdout``, ``stderr``, ``message``, ``file`` (bytes), and the terminal
``return`` and ``error``. Events are numbered from 0; a client reads "everything from index i on" and resumes
from the index it got back. The buffer keeps the newest ``capacity`` events (oldest dropped, like Pie's 4096-entry
ring) and at most ``event_log_bytes`` of them, but the terminal event is never dropped, so a late client always
learns how the instance ended. What an instance may emit is bounded (``event_limits.py``): an instance that goes over
is ended through ``exceeded`` (its host aborts it, so that it ends with an error naming the limit).

Events never pass through a cluster-wide actor: the node host that runs an instance (or the ingress, for the
cluster's own programs) keeps its ``Channel``, and ``follow`` asks the launcher once where that is, then reads the
events from there. The launcher only learns how each instance ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray.exceptions
from pie_workers.deadlines import LAUNCHER_S, NoAnswer, answer

from pie_cluster.hosts.event_limits import KINDS, STREAMS, TERMINAL, OutputQuota, check_event, limit, size_of
from pie_cluster.hosts.inbox import Inbox, check_room
from pie_cluster.instance import Launch
from pie_cluster.limits import ChannelLimits

__all__ = [
    "KINDS",
    "TERMINAL",
    "Channel",
    "Channels",
    "Ending",
    "Event",
    "EventBatch",
    "EventLog",
    "Location",
    "NotFound",
]

log = logging.getLogger(__name__)


class NotFound(LookupError):
    """No such instance or program for this user (another user's answers the same, so ids cannot be probed)."""


@dataclass(frozen=True)
class Event:
    index: int
    kind: str
    value: str | bytes
    size: int = 0  # bytes, as counted against ``event_log_bytes``

    def as_wire(self) -> list:
        return [self.index, self.kind, self.value]


@dataclass(frozen=True)
class Ending:
    """How one instance ended (``kind``: ``return`` or ``error``), as its host or ingress tells the launcher: the
    launcher learns nothing else of an instance's events."""

    instance: str
    kind: str
    value: str | bytes


@dataclass(frozen=True)
class EventBatch:
    """One read of an instance's events: each as ``[index, kind, value]``, the index to read from next, and whether
    the terminal event is among them (nothing follows it)."""

    events: list[list]
    next_index: int
    done: bool


@dataclass(frozen=True)
class Location:
    """The launcher's answer to ``locate``: where an instance's events and inbox are, and how it ended."""

    host: Any | None  # the node host's actor handle; None while the instance waits for admission
    ending: tuple[str, str | bytes] | None  # its terminal event's kind and value, once the launcher knows it

    def last_batch(self, since: int) -> EventBatch:
        """The ending as a client reads it where the host cannot answer any more."""
        return EventBatch([[since, *self.ending]], since + 1, True)


class EventLog:
    def __init__(self, capacity: int = 4096, max_bytes: int = 8 << 20):
        self._events: deque[Event] = deque()
        self._capacity, self._max_bytes, self._bytes = capacity, max_bytes, 0
        self._next = 0
        self._changed = asyncio.Event()
        self.terminal: Event | None = None

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def append(self, kind: str, value: str | bytes, size: int | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        if self.done:
            return  # nothing follows a return or error
        event = Event(self._next, kind, value, size_of(value) if size is None else size)
        self._next += 1
        while self._events and (len(self._events) >= self._capacity or self._bytes + event.size > self._max_bytes):
            self._bytes -= self._events.popleft().size  # the oldest go (the terminal is always the newest)
        self._events.append(event)
        self._bytes += event.size
        if kind in TERMINAL:
            self.terminal = event
        self._changed.set()

    def since(self, index: int) -> list[Event]:
        """Buffered events numbered ``index`` or later, plus the terminal event even if it rotated out."""
        got = list(itertools.takewhile(lambda e: e.index >= index, reversed(self._events)))  # the newest: O(got)
        got.reverse()
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
    inbox: Inbox = field(default_factory=Inbox)
    waiting: set[asyncio.Future] = field(default_factory=set)
    launch: Launch | None = None  # what a restarted launcher learns of it from its host
    output: OutputQuota = field(default_factory=lambda: OutputQuota(0.0, time.monotonic()))
    ending: str | None = None  # why its host is ending it (it went over a limit): only its terminal event goes out

    def events(self, got: list[Event], since: int) -> EventBatch:
        """The answer to a poll: the events, where to resume, and whether the terminal one is among them."""
        return EventBatch(
            [e.as_wire() for e in got],
            got[-1].index + 1 if got else max(since, 0),
            self.log.done and (not got or got[-1] is self.log.terminal),
        )

    def put(self, kind: str, value: str | bytes) -> None:
        if self.log.done:
            raise ValueError("the instance has ended; it can no longer receive")
        self.inbox.put(kind, value)

    async def receive(self, kind: str):
        """What the client sends next (the instance's ``inferlet.session``); cancelled when the instance ends."""
        if self.log.done:
            raise RuntimeError("the instance has ended")
        waiter = asyncio.ensure_future(self.inbox.get(kind))
        self.waiting.add(waiter)
        try:
            return await waiter
        finally:
            self.waiting.discard(waiter)


@dataclass
class _Pending:
    """An event queued for this loop turn's flush; a stream's consecutive writes are kept as parts, joined once."""

    instance_id: str
    kind: str
    parts: list
    size: int

    def value(self) -> str | bytes:
        return self.parts[0] if len(self.parts) == 1 else "".join(self.parts)


class Channels:
    """The channels of the instances one process runs; ended ones stay readable until ``keep`` newer ones ended.
    Events are batched per event-loop turn (``emit``), and the endings of a turn go to ``ended`` in one call (the
    launcher's, which learns nothing else of an instance's events). ``exceeded(instance, reason)`` ends an instance
    that went over a limit (its host aborts it; False: it cannot, and the channel ends it here)."""

    def __init__(
        self,
        limits: ChannelLimits,
        ended: Callable[[list[Ending]], object],
        exceeded: Callable[[str, str], bool] = lambda instance_id, reason: False,
    ):
        self._limits = limits
        self._open: dict[str, Channel] = {}
        self._ended: OrderedDict[str, Channel] = OrderedDict()
        self._report_endings = ended
        self._exceeded = exceeded
        self._outbox: list[_Pending] = []
        self._latest: dict[str, _Pending] = {}  # each instance's newest event in the outbox

    def emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        """Queue an event for this loop turn's batch, within the instance's limits (``event_limits.py``); writes
        to one stream in one turn merge into one event. Raises ``TypeError`` for an unknown kind or a value of the
        wrong type (callers relay only what they checked)."""
        check_event(kind, value)
        channel = self._open.get(instance_id)
        if channel is None or (channel.ending is not None and kind not in TERMINAL):
            return
        if channel.ending is not None:  # however its program ended, it ends as its host ended it
            kind, value = "error", channel.ending
        if kind in TERMINAL and (marker := channel.output.marker(self._limits)):
            self._queue(instance_id, "stdout", marker, len(marker))
        limited = limit(kind, value, channel.output, time.monotonic(), self._limits)
        if limited.ending is not None:
            self._end(instance_id, channel, f"the instance was ended: {limited.ending}")
        elif limited.kind is not None:
            self._queue(instance_id, limited.kind, limited.value, limited.size)

    def _queue(self, instance_id: str, kind: str, value: str | bytes, size: int) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        latest = self._latest.get(instance_id)
        if kind in STREAMS and latest is not None and latest.kind == kind:
            latest.parts.append(value)
            latest.size += size
            return
        pending = self._latest[instance_id] = _Pending(instance_id, kind, [value], size)
        self._outbox.append(pending)

    def _end(self, instance_id: str, channel: Channel, reason: str) -> None:
        """End an instance that went over a limit: its host aborts it with ``reason``, or it ends here."""
        channel.ending = reason
        if not self._exceeded(instance_id, reason):
            self._queue(instance_id, "error", reason, size_of(reason))

    def _flush(self) -> None:
        """Each instance's events of this turn into its log; one instance's failure loses no other's."""
        batch, self._outbox = self._outbox, []
        self._latest.clear()
        endings = []
        for pending in batch:
            try:
                if ending := self.append(pending.instance_id, pending.kind, pending.value(), pending.size):
                    endings.append(Ending(pending.instance_id, ending.kind, ending.value))
            except Exception:
                log.exception("an event of instance %s was lost", pending.instance_id)
        if endings:
            self._report_endings(endings)

    def open(self, instance_id: str, user: str) -> Channel:
        limits = self._limits
        output = OutputQuota(limits.stdout_burst_bytes, time.monotonic())
        events = EventLog(limits.event_buffer, limits.event_log_bytes)
        channel = self._open[instance_id] = Channel(user, events, output=output)
        return channel

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

    def deliver(self, user: str, instance_id: str, kind: str, value: str | bytes) -> None:
        """The client's message or file into the instance's inbox, within its and its user's bounds here
        (``inbox.py``: ``InboxFull`` past them)."""
        channel = self.own(user, instance_id)
        user_queued = sum(c.inbox.queued_bytes for c in self._open.values() if c.user == user)
        check_room(instance_id, channel.inbox, user_queued, size_of(value), self._limits)
        channel.put(kind, value)

    def append(self, instance_id: str, kind: str, value: str | bytes, size: int | None = None) -> Event | None:
        """Add an event; returns it when it was the instance's terminal one (the channel is then closed)."""
        channel = self._open.get(instance_id)
        if channel is None:
            return None
        channel.log.append(kind, value, size)
        if not channel.log.done:
            return None
        del self._open[instance_id]
        for waiter in list(channel.waiting):
            waiter.cancel()
        self._ended[instance_id] = channel
        while len(self._ended) > self._limits.keep_finished:
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
    where: Location | None = None,
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
                ended, since = polled.done, polled.next_index
                yield polled.events
            return
        where = where or await locate(launcher, user, instance, wait)
        while not ended:
            polled = await _poll(where.host, user, instance, since, wait)
            if polled is not None:
                ended, since = polled.done, polled.next_index
                yield polled.events
            elif where.ending is not None:  # its host is gone or forgot it: the launcher knows how it ended
                ended = True
                yield where.last_batch(since).events
            else:  # queued, or its host just died and the launcher has not yet noticed
                if where.host is not None:
                    await asyncio.sleep(0.5)
                where = await locate(launcher, user, instance, wait)
                if where.host is None and where.ending is None:
                    yield []
    finally:
        if abort_on_close and not ended:
            launcher.abort.remote(user, instance)


async def locate(launcher, user: str, instance: str, wait: float = 0.0) -> Location:
    """Where the instance runs and how it ended, once the launcher knows; waits up to ``wait`` s for a queued one
    to start. Raises ``NotFound`` (inside Ray's ``RayTaskError``) for another user's or an unknown id."""
    return await answer(launcher.locate.remote(user, instance, wait), "the launcher", wait + LAUNCHER_S)


async def _poll(host, user: str, instance: str, since: int, wait: float) -> EventBatch | None:
    """One long poll of the host's channel; None if there is no host, or it is dead, hung, or no longer knows it."""
    if host is None:
        return None
    try:
        return await answer(host.events.remote(user, instance, since, wait), "the inferlet host", wait + LAUNCHER_S)
    except (ray.exceptions.RayError, NoAnswer):
        return None
