"""The host <-> worker socket: msgpack frames, each a list of messages, batched per event-loop turn.

host -> worker::

    ["start", InstanceSpec as a dict]     run an instance (its program is already under /pie/programs)
    ["abort", instance, reason]            cancel it; it ends with an error event carrying ``reason``
    ["reply", rid, error or None, value]   the answer to a worker's ``receive``
    ["ping", seq]                          the worker answers ``pong`` unless its event loop is stuck

worker -> host::

    ["event", instance, kind, value]       stdout, stderr, message, file; then return or error (terminal)
    ["receive", instance, kind, rid]       wait for the client's next message or file
    ["pong", seq]

Nothing a worker sends is trusted: the host checks that each instance named is one it started on that worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgpack
from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint

from pie_cluster.host import InstanceSetup

MAX_FRAME_BYTES = 256 << 20  # a worker that sends more in one frame is broken or hostile: it is ended


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
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> InstanceSpec:
        setup = data["setup"]
        mcp = {
            name: ServerSpec(command=tuple(s["command"]) if s["command"] else None, url=s["url"], env=s["env"])
            for name, s in setup["mcp_servers"].items()
        }
        endpoints = {
            name: ModelEndpoint(**{**e, "failover": tuple(e["failover"])}) for name, e in setup["endpoints"].items()
        }
        setup = InstanceSetup(**{**setup, "endpoints": endpoints, "bus": tuple(setup["bus"]), "mcp_servers": mcp})
        return cls(setup, ProgramRef(**data["program"]), data["input"])


class FrameWriter:
    """Queues messages and writes them as one frame at the end of the current event-loop turn."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._outbox: list[list] = []

    def send(self, *message) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(list(message))

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and not self._writer.is_closing():
            self._writer.write(msgpack.packb(batch, use_bin_type=True))

    def close(self) -> None:
        self._flush()
        self._writer.close()


async def read_frames(reader: asyncio.StreamReader, handle: Callable[[list], None]) -> None:
    """Call ``handle`` with each message until the peer closes; a malformed stream raises ``ValueError``."""
    unpacker = msgpack.Unpacker(max_buffer_size=MAX_FRAME_BYTES, raw=False)
    while data := await reader.read(1 << 16):
        unpacker.feed(data)
        for frame in unpacker:
            if not isinstance(frame, list):
                raise ValueError("a frame must be a list of messages")
            for message in frame:
                if not isinstance(message, list) or not message or not isinstance(message[0], str):
                    raise ValueError(f"malformed message {message!r:.80}")
                handle(message)
