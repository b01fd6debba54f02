"""The inferlet's side of its channel to a replica: stream sockets carrying batched msgpack frames.

Many inferlets share one process (and one event loop), and in lock-step decoding they all send a forward at once.
So each process holds one *link* per (event loop, replica): every request made during one loop iteration goes out
as a single frame ``[[request id, session, op, args], ...]`` and replies come back batched the same way. Every
connection begins with a handshake, ``["hello", capability]``, of the session that opened it (sent again on every
new connection, after a failover too): the replica reads nothing else before it. A session string
``capability/session`` in each request tells the replica who sends it (the instance's capability, minted by the
trusted host: the replica believes nothing else) and which inferlet run's contexts it touches. A refusal of the
connection (``[None, "PermissionError", why]``: a capability forged, expired, not granted this model, of an ended
instance, or past a connection limit) fails every call on it with ``PermissionError`` and the replica hangs up; a
refusal of one request fails that call alone. Synchronous control
calls (``Context(model)``, ``fork``, ``open``...) use a blocking socket per (thread, replica) and cost one round
trip (~0.1 ms). Addresses are ``ipc://<unix socket path>`` (same node) or ``tcp://<host>:<port>``. A replica that
left answers every call ``ReplicaMoved``, with the ``MovedNotice`` naming where its contexts went.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from typing import Any

import msgpack
from pie_workers.wire.messages import MovedNotice, decode

from inferlet.runtime import QuotaExceeded, TokenBudgetExhausted

# Error types the replica reports that are the caller's fault: re-raised as ValueError with the replica's message.
_CALLER_ERRORS = {"ValueError", "ContextError", "BatchError", "BrleError", "KeyError", "LookupError", "OutOfPages"}
_REFUSED = "PermissionError"  # the replica did not believe the capability: raised as itself, and it hangs up
# the connection's every instance ended (the trusted side revoked them): it hangs up, and a new connection is opened
_REVOKED = "RevokedError"
# Limits the replica enforces for the trusted side: raised as the SDK's own exceptions of the same names.
_LIMITS = {"QuotaExceeded": QuotaExceeded, "TokenBudgetExhausted": TokenBudgetExhausted}


class ReplicaError(RuntimeError):
    """The replica failed for a reason that is not the caller's input."""


class ReplicaLost(ReplicaError):
    """The replica could not be reached, or its connection broke: it died, or it is being replaced."""


class ReplicaMoved(ReplicaLost):
    """The replica left, handing its contexts with their KV to the one ``notice`` names (``inferlet._failover``
    claims them there)."""

    def __init__(self, notice: MovedNotice):
        super().__init__(f"replica {notice.source} left; its contexts moved to {', '.join(notice.addresses)}")
        self.notice = notice


class _AsyncLink(asyncio.Protocol):
    """One connection per (event loop, replica address); batches every request of a loop iteration into a frame.
    Requests made while it connects wait in the outbox; a lost connection fails what is pending, and the next call
    opens a new link."""

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop, capability: str):
        self.address = address
        self._loop = loop
        self._hello = _hello(capability)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._outbox: list[list] = []
        self._unpacker = msgpack.Unpacker()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.users = 0
        self._connecting = loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            kind, where = _parse(self.address)
            if kind == "ipc":
                await self._loop.create_unix_connection(lambda: self, where)
            else:
                await self._loop.create_connection(lambda: self, *where)
        except OSError as e:
            self._fail(ReplicaLost(f"cannot reach the replica at {self.address}: {e}"))

    def call(self, session: str, op: str, args: list) -> asyncio.Future:
        fut = self._loop.create_future()
        if self.closed:
            fut.set_exception(ReplicaLost(f"the connection to the replica at {self.address} is closed"))
            return fut
        rid = next(self._ids)
        self._pending[rid] = fut
        if not self._outbox and self._transport is not None:
            self._loop.call_soon(self._flush)
        self._outbox.append([rid, session, op, args])
        return fut

    def _flush(self) -> None:
        if self._transport is not None and self._outbox:
            batch, self._outbox = self._outbox, []
            self._transport.write(msgpack.packb(batch))

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        transport.write(self._hello)
        self._flush()

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        for frame in self._unpacker:
            for rid, error, value in frame:
                fut = self._pending.pop(rid, None)
                if fut is None or fut.done():
                    pass
                elif error is None:
                    fut.set_result(value)
                else:
                    fut.set_exception(_error(error, value))
                if rid is None and error in (_REFUSED, _REVOKED):  # its last word here: later calls need a new one
                    self._transport.close()
                    why = f"the replica at {self.address} refused the connection: {value}"
                    self._fail(PermissionError(why) if error == _REFUSED else ReplicaLost(why))
                    return

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ReplicaLost(f"lost the connection to the replica at {self.address}"))

    def _fail(self, error: Exception) -> None:
        self.closed, self._transport, self._outbox = True, None, []
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)

    def close(self) -> None:
        self._connecting.cancel()
        if self._transport is not None:
            self._transport.close()
        self.closed = True


class _SyncLink:
    """A blocking socket per (thread, replica address) for control calls that must answer before returning."""

    def __init__(self, address: str, capability: str):
        kind, where = _parse(address)
        try:
            if kind == "tcp":
                self._sock = socket.create_connection(where)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    self._sock.connect(where)
                except OSError:
                    self._sock.close()
                    raise
        except OSError as e:
            raise ReplicaLost(f"cannot reach the replica at {address}: {e}") from None
        self._address = address
        self._unpacker = msgpack.Unpacker()
        self._ids = itertools.count()
        self.closed = False
        self._pending_hello = _hello(capability)  # sent with the first call

    def call(self, session: str, op: str, args: list) -> Any:
        rid = next(self._ids)
        hello, self._pending_hello = self._pending_hello, b""
        try:
            self._sock.sendall(hello + msgpack.packb([[rid, session, op, args]]))
            error, value = self._reply(rid)
        except PermissionError:  # the replica refused the connection, and hung up
            self.closed = True
            self._sock.close()
            raise
        except OSError as e:
            self.closed = True
            self._sock.close()
            raise ReplicaLost(f"lost the connection to the replica at {self._address}: {e}") from None
        if error is None:
            return value
        raise _error(error, value)

    def _reply(self, rid: int) -> tuple[str | None, Any]:
        """The answer to ``rid``; ``PermissionError`` when the replica refused the connection (in the same frame)."""
        found: tuple[str | None, Any] | None = None
        while True:
            for frame in self._unpacker:
                for got, error, value in frame:
                    if got is None and error == _REFUSED:
                        raise PermissionError(f"the replica at {self._address} refused the connection: {value}")
                    if got is None and error == _REVOKED:
                        raise OSError(value)
                    if got == rid:
                        found = error, value
                if found is not None:
                    return found
            data = self._sock.recv(1 << 16)
            if not data:
                raise OSError("closed by the replica")
            self._unpacker.feed(data)

    def stale(self) -> bool:
        """Whether the replica hung up while this link sat idle (every instance it carried ended; or it died): the
        replica never speaks unasked, so anything waiting to be read says so."""
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            pass
        self.closed = True
        self._sock.close()
        return True


def _hello(capability: str) -> bytes:
    """The handshake that opens a connection: the capability of the session that opened it."""
    return msgpack.packb(["hello", capability])


def _parse(address: str) -> tuple[str, Any]:
    """``ipc://path`` -> ("ipc", path); ``tcp://host:port`` -> ("tcp", (host, port))."""
    kind, _, where = address.partition("://")
    if kind == "ipc":
        return kind, where
    if kind == "tcp":
        host, _, port = where.rpartition(":")
        return kind, (host, int(port))
    raise ValueError(f"not a replica channel address: {address!r}")


_async_links: dict[tuple[asyncio.AbstractEventLoop, str], _AsyncLink] = {}
_sync_links = threading.local()


class Channel:
    """One inferlet session's view of a replica: awaited calls (forwards) and blocking control calls."""

    def __init__(self, address: str, session: str):
        self._address = address
        self._session = session
        self._capability = session.partition("/")[0]
        self._link: _AsyncLink | None = None

    def call_sync(self, op: str, *args: Any) -> Any:
        links = _sync_links.__dict__
        link = links.get(self._address)
        if link is None or link.closed or link.stale():
            link = links[self._address] = _SyncLink(self._address, self._capability)
        return link.call(self._session, op, list(args))

    def call(self, op: str, *args: Any) -> asyncio.Future:
        """Queue the request for this loop iteration's frame; await the returned future for the result."""
        link = self._link
        if link is None or link.closed:
            loop = asyncio.get_running_loop()
            link = _async_links.get((loop, self._address))
            if link is None or link.closed:
                link = _async_links[(loop, self._address)] = _AsyncLink(self._address, loop, self._capability)
            link.users += 1
            self._link = link
        return link.call(self._session, op, list(args))

    def close(self) -> None:
        """Drop this session's hold on the shared link; the last session on a link closes its socket."""
        link, self._link = self._link, None
        if link is not None:
            link.users -= 1
            if link.users == 0:
                if _async_links.get((link._loop, self._address)) is link:
                    del _async_links[link._loop, self._address]
                link.close()


def _error(error: str, value: Any) -> Exception:
    if error == "ReplicaMoved":
        return ReplicaMoved(decode(MovedNotice, value))
    if error in _LIMITS:
        return _LIMITS[error](value)
    if error in _CALLER_ERRORS:
        return ValueError(value)
    if error == _REFUSED:
        return PermissionError(value)
    return ReplicaError(f"{error}: {value}")
