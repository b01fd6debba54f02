"""The inferlet's side of its channel to a replica: ZeroMQ DEALER sockets carrying batched msgpack requests.

Many inferlets share one process (and one event loop), and in lock-step decoding they all send a forward at once.
So each process holds one *link* per (event loop, replica): every request made during one loop iteration goes out
as a single frame ``[[request id, session, op, args], ...]`` and replies come back batched the same way. A session
string ``user/instance/session`` in each request tells the replica whose contexts it touches. Synchronous control
calls (``Context(model)``, ``fork``, ``open``...) use a blocking socket per (thread, replica) and cost one round
trip (~0.1-0.2 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import msgpack
import zmq
import zmq.asyncio

# Error types the replica reports that are the caller's fault: re-raised as ValueError with the replica's message.
_CALLER_ERRORS = {"ValueError", "ContextError", "BatchError", "BrleError", "KeyError", "LookupError", "OutOfPages"}


class ReplicaError(RuntimeError):
    """The replica failed for a reason that is not the caller's input."""


class _AsyncLink:
    """One DEALER socket per (event loop, replica address); batches every request of a loop iteration into a frame."""

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop a send: the replica applies backpressure
        self._sock.connect(address)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._outbox: list[list] = []
        self._reader = loop.create_task(self._read())
        self.users = 0

    def call(self, session: str, op: str, args: list) -> asyncio.Future:
        rid = next(self._ids)
        fut = self._loop.create_future()
        self._pending[rid] = fut
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append([rid, session, op, args])
        return fut

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        # the asyncio socket's own send: after it, it re-checks ZeroMQ's edge-triggered descriptor for replies that
        # arrived meanwhile (a send on a raw shadow socket skips that, and the reader can then sleep forever)
        self._sock.send(msgpack.packb(batch), zmq.NOBLOCK)

    async def _read(self) -> None:
        while True:
            for rid, error, value in msgpack.unpackb(await self._sock.recv()):
                fut = self._pending.pop(rid, None)
                if fut is None or fut.done():
                    continue
                if error is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(_error(error, value))

    def close(self) -> None:
        self._reader.cancel()
        self._sock.close(linger=0)


class _SyncLink:
    """A blocking DEALER socket per (thread, replica address) for control calls that must answer before returning."""

    def __init__(self, address: str):
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.connect(address)
        self._ids = itertools.count()

    def call(self, session: str, op: str, args: list) -> Any:
        rid = next(self._ids)
        self._sock.send(msgpack.packb([[rid, session, op, args]]))
        while True:
            for got, error, value in msgpack.unpackb(self._sock.recv()):
                if got == rid:
                    if error is None:
                        return value
                    raise _error(error, value)


_async_links: dict[tuple[asyncio.AbstractEventLoop, str], _AsyncLink] = {}
_sync_links = threading.local()


class Channel:
    """One inferlet session's view of a replica: awaited calls (forwards) and blocking control calls."""

    def __init__(self, address: str, session: str):
        self._address = address
        self._session = session
        self._link: _AsyncLink | None = None

    def call_sync(self, op: str, *args: Any) -> Any:
        links = _sync_links.__dict__
        link = links.get(self._address)
        if link is None:
            link = links[self._address] = _SyncLink(self._address)
        return link.call(self._session, op, list(args))

    def call(self, op: str, *args: Any) -> asyncio.Future:
        """Queue the request for this loop iteration's frame; await the returned future for the result."""
        link = self._link
        if link is None:
            loop = asyncio.get_running_loop()
            link = _async_links.get((loop, self._address))
            if link is None:
                link = _async_links[(loop, self._address)] = _AsyncLink(self._address, loop)
            link.users += 1
            self._link = link
        return link.call(self._session, op, list(args))

    def close(self) -> None:
        """Drop this session's hold on the shared link; the last session on a link closes its socket."""
        link, self._link = self._link, None
        if link is not None:
            link.users -= 1
            if link.users == 0:
                _async_links.pop((link._loop, self._address), None)
                link.close()


def _error(error: str, value: Any) -> Exception:
    if error in _CALLER_ERRORS:
        return ValueError(value)
    return ReplicaError(f"{error}: {value}")
