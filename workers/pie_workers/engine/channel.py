"""The replica's side of the inferlet channel: plain stream sockets carrying batched msgpack frames.

A plain Ray actor call costs 0.6-1 ms; a forward pass per token cannot afford that. Inferlet processes on the same
node connect over a Unix socket, others over TCP. A frame is one msgpack value and carries every request a process
made in one loop iteration, ``[[request id, session, op, args], ...]``; replies go back batched per connection the
same way, each ``[request id, error type or None, result or message]`` (or, for an error that carries a record,
such as ``ReplicaMoved``, the record), written once per loop iteration (so the 32
replies of one batch leave in one frame). The handler starts each request at once: an operation it takes on itself
(a forward, queued for its batch) it answers through a callback, anything else runs as its own task; either way a
slow operation never blocks the others.

Identity comes before anything else. A connection's first frame is its handshake, ``["hello", capability]``; until
it verifies, the connection is read ``HANDSHAKE_BYTES`` at a time at most and nothing else is parsed, and one that
sends anything else, takes longer than ``handshake_s``, or has too many siblings waiting from the same peer (Unix
uid, or IP) is answered ``[None, "PermissionError", why]`` and closed: never a traceback, and refusals are logged
at a bounded rate. A verified connection carries the requests of the instance that opened it and of any other
instance of the same process (a pooled worker runs several of its user's instances; the ingress runs many), each
session string ``capability/session`` verified once per token; every instance and user holds a bounded number of
connections (``ConnectionLimits``). A forged capability in a request closes the connection as a failed handshake
does; a request of an instance that ended fails alone. When the trusted side revokes an instance, a connection that
carries no other instance is closed.

The sockets are asyncio's own, read and written by the event loop's thread: no broker thread sits between the
loop and the kernel. (ZeroMQ's I/O thread cost two thread wake-ups per frame; on a 2-core node whose cores the model
keeps busy, one inferlet's tax went from 0.34 to 0.27 ms/token without them, in 30 paired rounds.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from pie_workers.engine.record import Sessions
from pie_workers.wire.admission import ConnectionLimits, Holders, RefusalLog, RevokedError
from pie_workers.wire.capability import CapabilityError

log = logging.getLogger(__name__)

Answer = Callable[[BaseException | None, Any], None]  # (error or None, result): the reply to one request
# (session, op, args, answer) -> the operation as an awaitable to run as a task, whose outcome is the reply; or
# None when the handler took the operation on itself and will call ``answer``
Handler = Callable[[str, str, list, Answer], Awaitable[Any] | None]
Disconnected = Callable[[set[str]], None]  # the sessions seen on a connection that closed

MAX_FRAME_BYTES = 64 << 20
"""Bound on one incoming frame of a verified connection (a forward of a 32k-token prompt with masks is well under
1 MiB): past it the connection is dropped instead of buffered."""
HANDSHAKE_BYTES = 8 << 10
"""What an unverified connection may send: its handshake (a capability is at most 4,096 characters)."""
READ_BYTES = 256 << 10  # one read of a verified connection (asyncio's own default)
_CALLERS_FAULT = (ValueError, LookupError, TypeError, PermissionError)  # errors of the request, not of the replica


class _Connection(asyncio.BufferedProtocol):
    """One inferlet process's connection: a handshake, then frames in and batched replies out. Buffered, so that
    an unverified one is read no further than its handshake's room."""

    def __init__(self, server: ChannelServer):
        self._server = server
        self._buffer = bytearray(HANDSHAKE_BYTES)
        self._greeting: int | None = 0  # handshake bytes read so far; None once it verified
        self._unpacker = msgpack.Unpacker(max_buffer_size=HANDSHAKE_BYTES)
        self.transport: asyncio.Transport | None = None
        self.peer: object = None  # the Unix uid or IP address it comes from
        self.sessions: set[str] = set()  # open sessions that sent requests here: closed for them if it drops
        self.refused = False  # refused: nothing more is read or answered

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.peer = _peer(transport)
        self._server._opened(self)

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._greeting is None:
            return self._buffer
        if self.refused:  # closing: whatever still comes is dropped
            return bytearray(4096)
        return memoryview(self._buffer)[self._greeting :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.refused:
            return
        if self._greeting is None:
            self._unpacker.feed(memoryview(self._buffer)[:nbytes])
            self._frames()
            return
        start, self._greeting = self._greeting, self._greeting + nbytes
        self._unpacker.feed(memoryview(self._buffer)[start : self._greeting])
        try:
            hello = self._unpacker.unpack()
        except msgpack.OutOfData:
            if self._greeting >= HANDSHAKE_BYTES:
                self._server._refuse(self, None, CapabilityError(f"no handshake within {HANDSHAKE_BYTES} bytes"))
            return
        except Exception as e:
            self._server._refuse(self, None, CapabilityError(f"malformed handshake: {type(e).__name__}"))
            return
        rest = bytes(self._buffer[self._unpacker.tell() : self._greeting])
        if not self._server._greet(self, hello):
            return
        self._greeting, self._buffer = None, bytearray(READ_BYTES)
        self._unpacker = msgpack.Unpacker(max_buffer_size=MAX_FRAME_BYTES)
        if rest:
            self._unpacker.feed(rest)
            self._frames()

    def _frames(self) -> None:
        try:
            for frame in self._unpacker:
                if self.refused:
                    return
                self._server._received(self, frame)
        except Exception as e:  # not our protocol: the stream cannot be resynchronised, so drop the connection
            self._server._refuse(self, None, CapabilityError(f"malformed frame: {type(e).__name__}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._server._closed(self)


def _peer(transport: asyncio.Transport) -> object:
    """Who is at the other end, as far as the kernel says: a Unix socket's uid, a TCP connection's IP address."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return ("uid", uid)
    peername = transport.get_extra_info("peername")
    return ("ip", peername[0] if isinstance(peername, tuple) else peername)


class ChannelServer:
    def __init__(
        self,
        handler: Handler,
        sessions: Sessions,
        on_disconnect: Disconnected | None = None,
        limits: ConnectionLimits | None = None,
    ):
        """``sessions`` verifies handshakes and the capabilities of the requests that follow. ``on_disconnect``
        learns which sessions a closed connection carried, so that what an inferlet process held is released even
        when it died without saying goodbye (its host killed, its node lost)."""
        self._handler = handler
        self._sessions = sessions
        self._on_disconnect = on_disconnect
        self._limits = limits = limits or ConnectionLimits()
        self._holders = Holders(limits)
        self._waiting: dict[object, dict[_Connection, asyncio.TimerHandle]] = {}  # peer -> unverified, oldest first
        self._refusals = RefusalLog(log)
        self._listeners: list[socket.socket] = []
        self._servers: list[asyncio.Server] = []  # own the listeners once serving
        self._tasks: set[asyncio.Task] = set()
        self._outbox: dict[_Connection, list] = {}
        self._connections: set[_Connection] = set()
        self.addresses: dict[str, str] = {}

    def bind(self, host_ip: str) -> dict[str, str]:
        """Listen on tcp (reachable from every node) and on a Unix socket (the same-node fast path)."""
        tcp = socket.create_server((host_ip, 0), backlog=512)
        ipc = os.path.join(tempfile.gettempdir(), f"pie-{uuid.uuid4().hex[:12]}.sock")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(ipc)
        os.chmod(ipc, 0o666)  # sandboxed workers have uids of their own; the capability check is what guards it
        unix.listen(512)
        self._listeners = [tcp, unix]
        port = tcp.getsockname()[1]
        self.addresses = {"tcp": f"tcp://{host_ip}:{port}", "ipc": f"ipc://{ipc}", "ipc_path": ipc}
        return self.addresses

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        tcp, unix = self._listeners
        self._servers = [
            await loop.create_server(lambda: _Connection(self), sock=tcp),
            await loop.create_unix_server(lambda: _Connection(self), sock=unix),
        ]
        await asyncio.gather(*(s.serve_forever() for s in self._servers))

    # -- connections and their handshakes ------------------------------------------------------------------------

    def _opened(self, conn: _Connection) -> None:
        """A new connection waits for its handshake, at most ``handshake_s``; past ``waiting_per_peer`` of its peer's,
        the oldest is closed (a client that verifies does so at once, so the oldest is the likeliest stuck)."""
        self._connections.add(conn)
        waiting = self._waiting.setdefault(conn.peer, {})
        if len(waiting) >= self._limits.waiting_per_peer:
            oldest = next(iter(waiting))
            self._stop_waiting(oldest)  # (it is being closed)
            waiting = self._waiting.setdefault(conn.peer, {})
            why = f"waiting_per_peer = {self._limits.waiting_per_peer} connections of this peer wait for a handshake"
            self._refuse(oldest, None, ConnectionRefusedError(f"too many unverified connections ([limits] {why})"))
        late = CapabilityError(f"no handshake within {self._limits.handshake_s:g} s")
        waiting[conn] = asyncio.get_running_loop().call_later(self._limits.handshake_s, self._refuse, conn, None, late)

    def _greet(self, conn: _Connection, hello: Any) -> bool:
        """Verify the handshake; False when it refused the connection."""
        try:
            if not (isinstance(hello, list) and len(hello) == 2 and hello[0] == "hello"):
                raise CapabilityError('the first frame must be the handshake ["hello", capability]')
            self._holders.join(conn, self._sessions.verify(hello[1]))
        except PermissionError as e:
            self._refuse(conn, None, e)
            return False
        self._stop_waiting(conn)
        return True

    def _stop_waiting(self, conn: _Connection) -> None:
        """``conn`` no longer waits for its handshake (it verified, or is closed): its deadline is off."""
        waiting = self._waiting.get(conn.peer)
        if waiting is not None:
            timer = waiting.pop(conn, None)
            if timer is not None:
                timer.cancel()
            if not waiting:
                del self._waiting[conn.peer]

    def _closed(self, conn: _Connection) -> None:
        self._stop_waiting(conn)
        self._holders.leave(conn)
        self._connections.discard(conn)
        self._outbox.pop(conn, None)
        if conn.sessions and self._on_disconnect is not None:
            self._on_disconnect(conn.sessions)

    def revoke(self, instances: set[str]) -> None:
        """These instances ended: no connection carries them any more, and one that carried nothing else closes."""
        for instance in instances:
            for conn in self._holders.of_instance(instance):
                self._holders.drop(conn, instance)
                if not self._holders.carries(conn):
                    why = RevokedError(f"revoked capability: instance {instance!r} has ended")
                    self._refuse(conn, None, why, revoked=True)

    # -- requests ------------------------------------------------------------------------------------------------

    def _received(self, conn: _Connection, frame: list) -> None:
        for request in frame:
            rid = None
            try:
                rid, session, op, args = request
                if session not in conn.sessions:
                    self._holders.join(conn, self._sessions.admit(session).grants)
                    conn.sessions.add(session)
                work = self._handler(session, op, args, functools.partial(self._reply, conn, rid))
            except CapabilityError as e:
                self._refuse(conn, rid, e)
                return
            except Exception as e:
                self._reply(conn, rid, e)
                continue
            if work is not None:
                task = asyncio.get_running_loop().create_task(self._run(conn, rid, work))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: _Connection, rid: int, work: Awaitable) -> None:
        try:
            result = await work
        except Exception as e:
            self._reply(conn, rid, e)
        else:
            self._reply(conn, rid, None, result)

    def _reply(self, conn: _Connection, rid: int | None, error: BaseException | None, result: Any = None) -> None:
        """Queue a reply for this loop iteration's frame to ``conn``; every failure goes back to the inferlet that
        caused it (one of the replica's own is logged too, at a bounded rate)."""
        if error is None:
            reply = [rid, None, result]
        else:
            wire = getattr(error, "wire", None)  # an error that is an answer (``ReplicaMoved``): its record
            if not isinstance(error, _CALLERS_FAULT) and wire is None:
                self._refusals.refused("nothing: a channel op failed", error, exc_info=error)
            reply = [rid, type(error).__name__, str(error) if wire is None else wire]
        self._queue(conn, reply)

    def _queue(self, conn: _Connection, reply: list) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outbox.setdefault(conn, []).append(reply)

    def _refuse(self, conn: _Connection, rid: int | None, error: Exception, revoked: bool = False) -> None:
        """Say why (to the request ``rid``, if one caused it, and to the connection: ``[None, "PermissionError",
        why]``, or ``"RevokedError"`` when every instance it carried ended, which its client may open anew for
        another), send what is queued, and close the connection (what its sessions held is released as for any
        connection that drops)."""
        if conn.refused or conn.transport is None:
            return
        if not revoked:
            self._refusals.refused(f"an inferlet connection from {conn.peer}", error)
        if rid is not None:
            self._queue(conn, [rid, "PermissionError", str(error)])
        self._queue(conn, [None, "RevokedError" if revoked else "PermissionError", str(error)])
        self.flush()
        conn.refused = True
        conn.transport.close()

    def forget(self, session: str) -> None:
        """``session`` closed itself: its connection need not close it again."""
        for conn in self._connections:
            conn.sessions.discard(session)

    def flush(self) -> None:
        """Send the replies queued so far (each connection's in one frame); otherwise they leave once the event
        loop turns."""
        outbox, self._outbox = self._outbox, {}
        for conn, replies in outbox.items():
            if conn.transport is not None and not conn.refused:  # else the inferlet's process is gone, or refused
                conn.transport.write(msgpack.packb(replies))

    def close(self) -> None:
        for server in self._servers:
            server.close()
        if not self._servers:
            for sock in self._listeners:
                sock.close()
        for conn in list(self._connections):
            if conn.transport is not None:
                conn.transport.close()
        if path := self.addresses.get("ipc_path"):
            with contextlib.suppress(OSError):
                os.unlink(path)
