"""The host <-> worker socket: msgpack frames, each a list of messages, batched per event-loop turn.

Each message is a record here (``StartMessage``, ... ``WaitingMessage``), sent as ``wire()`` and read back by
``host_message`` / ``worker_message``:

host -> worker::

    ["start", InstanceSpec as a dict]     run an instance (its program is already under /pie/programs)
    ["abort", instance, reason]            cancel it; it ends with an error event carrying ``reason``
    ["reply", rid, error or None, value]   the answer to a worker's ``receive``
    ["ping", seq]                          the worker answers ``pong`` unless its event loop is stuck

worker -> host::

    ["event", instance, kind, value]       stdout, stderr, message, file; then return or error (terminal)
    ["receive", instance, kind, rid]       wait for the client's next message or file
    ["pong", seq]
    ["waiting", bool]                      its loop is blocked on the cluster (a replica's replacement), or no more

Nothing a worker sends is trusted: each message is checked on receipt for its exact shape and types
(``worker_message``) and each instance it names must be one the host started on that worker; anything else ends
that worker. The host reads each worker at most ``MESSAGES_PER_TURN`` messages per event-loop turn and within
``WORKER_READ_RATE``, message by message, each at most ``MAX_WORKER_MESSAGE_BYTES`` (a frame is a stream of them), so
that no worker can hold the host's loop, its CPU or its memory. A worker's writes to one stream in one turn travel
as one message (``send_text``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import pydantic

from pie_cluster.config import EVENT_BYTES_CEILING
from pie_cluster.hosts.event_limits import check_event
from pie_cluster.instance import InstanceSetup

MAX_WORKER_MESSAGE_BYTES = EVENT_BYTES_CEILING + (64 << 10)  # the largest event value, framed: more ends the worker
MAX_HOST_MESSAGE_BYTES = 256 << 20  # from the trusted host (a launch's input)
TEXT_CHUNK_CHARS = 256 << 10  # a stream's writes merge into messages of at most this many characters (4 bytes each)
READ_BYTES = 1 << 16  # read from a socket at a time
MESSAGES_PER_TURN = 64  # handled from one socket before its reader lets the event loop run others (~1 ms)


class ProtocolError(ValueError):
    """What a peer sent is not this protocol."""


@dataclass(frozen=True)
class EventMessage:
    instance: str
    kind: str  # an event kind (``event_limits.KINDS``), ``value`` of its type
    value: str | bytes

    def wire(self) -> list:
        return ["event", self.instance, self.kind, self.value]


@dataclass(frozen=True)
class ReceiveMessage:
    instance: str
    kind: str  # "message" or "file"
    rid: int

    def wire(self) -> list:
        return ["receive", self.instance, self.kind, self.rid]


@dataclass(frozen=True)
class PongMessage:
    seq: int

    def wire(self) -> list:
        return ["pong", self.seq]


@dataclass(frozen=True)
class WaitingMessage:
    """The worker's event loop is blocked in an SDK call that waits for the cluster (``watchdog.py``): it cannot
    answer pings until the call returns, which may take as long as a replica's replacement loading its model."""

    waiting: bool

    def wire(self) -> list:
        return ["waiting", self.waiting]


def worker_message(message: list) -> WorkerMessage:
    """A worker's message, checked for its exact shape and types; raises ``ProtocolError`` naming what it was."""
    match message:
        case ["event", str(instance), str(kind), value]:
            try:
                check_event(kind, value)
            except TypeError as e:
                raise ProtocolError(f"it sent an event that is not one: {e}") from None
            return EventMessage(instance, kind, value)
        case ["receive", str(instance), "message" | "file" as kind, int(rid)] if type(rid) is int:
            return ReceiveMessage(instance, kind, rid)
        case ["pong", int(seq)] if type(seq) is int:
            return PongMessage(seq)
        case ["waiting", bool(waiting)]:
            return WaitingMessage(waiting)
    shape = ", ".join(type(part).__name__ for part in message[1:6])
    raise ProtocolError(f"it sent a malformed or unknown message: {message[0]!r:.40} with ({shape})")


@dataclass(frozen=True)
class ProgramRef:
    """A program as a worker finds it: its files under ``/pie/programs/<id>``."""

    id: str
    name: str
    version: str
    entry: str


@dataclass(frozen=True)
class InstanceSpec:
    """Everything a worker needs to run one instance: who it is (a capability it cannot forge) and what it reaches
    (as the sandbox sees it), its program and its input."""

    setup: InstanceSetup
    program: ProgramRef
    input: dict

    def to_wire(self) -> dict:
        return _SPEC.dump_python(self)

    @classmethod
    def from_wire(cls, data: dict) -> InstanceSpec:
        """The spec as the host sent it, its nested records (endpoints, MCP servers) rebuilt by their types."""
        return _SPEC.validate_python(data)


_SPEC = pydantic.TypeAdapter(InstanceSpec)


@dataclass(frozen=True)
class StartMessage:
    spec: InstanceSpec

    def wire(self) -> list:
        return ["start", self.spec.to_wire()]


@dataclass(frozen=True)
class AbortMessage:
    instance: str
    reason: str

    def wire(self) -> list:
        return ["abort", self.instance, self.reason]


@dataclass(frozen=True)
class ReplyMessage:
    """The answer to the worker's ``receive`` ``rid``: its value, or why there is none."""

    rid: int
    error: str | None
    value: object

    def wire(self) -> list:
        return ["reply", self.rid, self.error, self.value]


@dataclass(frozen=True)
class PingMessage:
    seq: int

    def wire(self) -> list:
        return ["ping", self.seq]


HostMessage = StartMessage | AbortMessage | ReplyMessage | PingMessage
WorkerMessage = EventMessage | ReceiveMessage | PongMessage | WaitingMessage
Message = HostMessage | WorkerMessage


def host_message(message: list) -> HostMessage:
    """A message from the trusted host, as a record; ``ProtocolError`` naming one that is not of this protocol (a
    host and worker of different versions)."""
    match message:
        case ["start", dict(spec)]:
            try:
                return StartMessage(InstanceSpec.from_wire(spec))
            except pydantic.ValidationError as e:
                raise ProtocolError(
                    f"the host sent a start this worker does not know: {e.errors()[0]['msg']}"
                ) from None
        case ["abort", str(instance), str(reason)]:
            return AbortMessage(instance, reason)
        case ["reply", int(rid), None | str() as error, value]:
            return ReplyMessage(rid, error, value)
        case ["ping", int(seq)]:
            return PingMessage(seq)
    raise ProtocolError(f"the host sent a message this worker does not know: {str(message)[:60]}")


class _Text(list):
    """The parts of a queued message's text, joined once when it is written."""


class FrameWriter:
    """Queues messages and writes them as one frame at the end of the current event-loop turn."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._outbox: list[list] = []
        self._text: tuple[tuple, _Text, int] | None = None  # the last queued event's (instance, kind), text, length

    def send(self, message: Message) -> None:
        self._queue(message.wire())

    def send_text(self, instance: str, kind: str, text: str) -> None:
        """Send a stream's text as ``EventMessage``s, merged into the last queued one when that is of the same
        instance and stream (its writes in one turn), of at most ``TEXT_CHUNK_CHARS`` characters each."""
        head = (instance, kind)
        for start in range(0, len(text), TEXT_CHUNK_CHARS):
            chunk = text[start : start + TEXT_CHUNK_CHARS]
            if self._text is not None and self._text[0] == head and self._text[2] + len(chunk) <= TEXT_CHUNK_CHARS:
                _, parts, length = self._text
                parts.append(chunk)
            else:
                parts, length = _Text([chunk]), 0
                self._queue(EventMessage(instance, kind, parts).wire())
            self._text = (head, parts, length + len(chunk))

    def send_now(self, message: Message) -> None:
        """Write ``message`` (after what is queued) at once, not at the end of the turn: for a worker whose loop is
        about to be blocked, where the turn would end too late."""
        self._outbox.append(message.wire())
        self._flush()

    def _queue(self, message: list) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)
        self._text = None

    def backlog(self) -> int:
        """Bytes written and not yet taken by the peer."""
        return self._writer.transport.get_write_buffer_size()

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        self._text = None
        for message in batch:
            if isinstance(message[-1], _Text):
                message[-1] = "".join(message[-1])
        if batch and not self._writer.is_closing():
            self._writer.write(msgpack.packb(batch, use_bin_type=True))

    def close(self) -> None:
        self._flush()
        self._writer.close()


@dataclass(frozen=True)
class ReadRate:
    """How fast a reader takes one peer's input (a tenth of a second's worth at once): past it, the reader waits and
    the peer's writes back up into its own socket, so that one peer's flood costs the host a bounded share of its
    CPU, spread evenly rather than in bursts that hold every turn of the loop for a while."""

    bytes_per_s: float
    messages_per_s: float


BURST_S = 0.1  # a reader's bucket holds this many seconds of its rate
WORKER_READ_RATE = ReadRate(8 << 20, 10_000)  # ~5% of a core's time for small messages (stdout lines, tokens)


class _Pace:
    """``ReadRate``'s token buckets; ``take`` yields to the event loop, for longer past the rate."""

    def __init__(self, rate: ReadRate | None):
        self._rate = rate
        self._bytes, self._messages = (rate.bytes_per_s * BURST_S, rate.messages_per_s * BURST_S) if rate else (0, 0)
        self._at = time.monotonic()

    async def take(self, nbytes: int, messages: int) -> None:
        rate, wait = self._rate, 0.0
        if rate is not None:
            now = time.monotonic()
            elapsed, self._at = now - self._at, now
            refilled = self._bytes + elapsed * rate.bytes_per_s
            self._bytes = min(rate.bytes_per_s * BURST_S, refilled) - nbytes
            refilled = self._messages + elapsed * rate.messages_per_s
            self._messages = min(rate.messages_per_s * BURST_S, refilled) - messages
            wait = max(0.0, -self._bytes / rate.bytes_per_s, -self._messages / rate.messages_per_s)
        await asyncio.sleep(wait)


async def read_frames(
    reader: asyncio.StreamReader,
    handle: Callable[[list], None],
    max_message_bytes: int = MAX_HOST_MESSAGE_BYTES,
    rate: ReadRate | None = None,
) -> None:
    """Call ``handle`` with each message until the peer closes, at most ``MESSAGES_PER_TURN`` per event-loop turn
    and within ``rate``. Frames are read message by message, so that neither a long frame nor a stream of small
    ones holds the loop; raises ``ProtocolError`` for what is not frames of messages, or a message over
    ``max_message_bytes``."""
    unpacker = msgpack.Unpacker(
        max_buffer_size=max_message_bytes + READ_BYTES, max_array_len=max(16, max_message_bytes >> 4), raw=False
    )
    pace = _Pace(rate)
    in_frame = 0  # messages of the current frame still to come
    while data := await reader.read(READ_BYTES):
        try:
            unpacker.feed(data)
        except msgpack.BufferFull:
            raise ProtocolError(f"a message of more than {max_message_bytes} bytes") from None
        handled = 0
        while True:
            try:
                if not in_frame:
                    in_frame = unpacker.read_array_header()
                    message = None
                else:
                    message = unpacker.unpack()
                    in_frame -= 1
            except msgpack.OutOfData:
                break
            except (ValueError, msgpack.UnpackException) as e:
                raise ProtocolError(f"not msgpack frames of messages: {e}") from None
            if message is not None:
                if not isinstance(message, list) or not message or not isinstance(message[0], str):
                    raise ProtocolError(f"a malformed message of type {type(message).__name__}")
                handle(message)
            handled += 1
            if handled == MESSAGES_PER_TURN:
                await pace.take(0, handled)
                handled = 0
        await pace.take(len(data), handled)  # a read of buffered data does not yield: this does
