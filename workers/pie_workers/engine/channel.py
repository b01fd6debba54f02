"""The replica's side of the inferlet channel: plain stream sockets carrying batched msgpack frames.

A plain Ray actor call costs 0.6-1 ms; a forward pass per token cannot afford that. Inferlet processes on the same
node connect over a Unix socket, others over TCP. A frame is one msgpack value and carries every request a process
made in one loop iteration, ``[[request id, session, op, args], ...]``; replies go back batched per connection the
same way, each ``[request id, error type or None, result or message]``, written once per loop iteration (so the 32
replies of one batch leave in one frame). The handler starts each request at once: an operation it takes on itself
(a forward, queued for its batch) it answers through a callback, anything else runs as its own task; either way a
slow operation never blocks the others.

Unauthenticated connections are refused: a request the handler rejects with a ``CapabilityError`` (its session's
capability is forged, expired or malformed) gets a ``PermissionError`` reply saying so, and the connection is closed
at once.

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
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from pie_workers.wire.capability import CapabilityError

log = logging.getLogger(__name__)

Answer = Callable[[BaseException | None, Any], None]  # (error or None, result): the reply to one request
# (session, op, args, answer) -> the operation as an awaitable to run as a task, whose outcome is the reply; or
# None when the handler took the operation on itself and will call ``answer``
Handler = Callable[[str, str, list, Answer], Awaitable[Any] | None]
Disconnected = Callable[[set[str]], None]  # the sessions seen on a connection that closed

MAX_FRAME_BYTES = 64 << 20
"""Bound on one incoming frame (a forward of a 32k-token prompt with masks is well under 1 MiB): past it the
connection is dropped instead of buffered."""


class _Connection(asyncio.Protocol):
    """One inferlet process's connection: frames in, batched replies out."""

    def __init__(self, server: ChannelServer):
        self._server = server
        self._unpacker = msgpack.Unpacker(max_buffer_size=MAX_FRAME_BYTES)
        self.transport: asyncio.Transport | None = None
        self.sessions: set[str] = set()  # open sessions that sent requests here: closed for them if it drops
        self.refused = False  # a request failed to prove who sent it: nothing more is read or answered

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._unpacker.feed(data)
        try:
            for frame in self._unpacker:
                if self.refused:
                    return
                self._server._received(self, frame)
        except Exception:  # not our protocol: the stream cannot be resynchronised, so drop the connection
            log.warning("closing an inferlet connection that sent a malformed frame", exc_info=True)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._server._connections.discard(self)
        if self.sessions and self._server._on_disconnect is not None:
            self._server._on_disconnect(self.sessions)


class ChannelServer:
    def __init__(self, handler: Handler, on_disconnect: Disconnected | None = None):
        """``on_disconnect`` learns which sessions a closed connection carried, so that what an inferlet process
        held is released even when it died without saying goodbye (its host killed, its node lost)."""
        self._handler = handler
        self._on_disconnect = on_disconnect
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

    def _received(self, conn: _Connection, frame: list) -> None:
        for request in frame:
            rid = None
            try:
                rid, session, op, args = request
                if session not in conn.sessions:
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
        caused it."""
        if error is None:
            reply = [rid, None, result]
        else:
            if not isinstance(error, (ValueError, KeyError, LookupError)):
                log.error("channel op failed", exc_info=error)
            reply = [rid, type(error).__name__, str(error)]
        self._queue(conn, reply)

    def _queue(self, conn: _Connection, reply: list) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outbox.setdefault(conn, []).append(reply)

    def _refuse(self, conn: _Connection, rid: int | None, error: CapabilityError) -> None:
        """Answer the request with why it was refused, send what is queued, and close the connection (what its
        sessions held is released as for any connection that drops)."""
        log.warning("closing an inferlet connection that failed to prove who it is: %s", error)
        self._queue(conn, [rid, "PermissionError", str(error)])
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
            conn.transport.close()
        if path := self.addresses.get("ipc_path"):
            with contextlib.suppress(OSError):
                os.unlink(path)
