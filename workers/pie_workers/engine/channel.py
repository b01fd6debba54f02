"""The replica's side of the inferlet channel: a ZeroMQ ROUTER socket serving msgpack request/response frames.

A plain Ray actor call costs 0.6-1 ms; a forward pass per token cannot afford that. Inferlets on the same node
connect over an ipc socket, others over tcp. Each frame is ``[request id, op, args]``; each reply is
``[request id, error type or None, result or message]``. Every request runs as its own task, so a slow operation
(a forward waiting for its batch) never blocks the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

Handler = Callable[[bytes, str, list], Awaitable[Any]]


class ChannelServer:
    def __init__(self, handler: Handler):
        self._handler = handler
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._tasks: set[asyncio.Task] = set()
        self.addresses: dict[str, str] = {}

    def bind(self, host_ip: str) -> dict[str, str]:
        """Listen on tcp (reachable from every node) and on an ipc path (same-node fast path)."""
        port = self._sock.bind_to_random_port(f"tcp://{host_ip}")
        ipc = os.path.join(tempfile.gettempdir(), f"pie-{uuid.uuid4().hex[:12]}.sock")
        self._sock.bind(f"ipc://{ipc}")
        self.addresses = {"tcp": f"tcp://{host_ip}:{port}", "ipc": f"ipc://{ipc}", "ipc_path": ipc}
        return self.addresses

    async def serve(self) -> None:
        while True:
            ident, frame = await self._sock.recv_multipart()
            task = asyncio.get_running_loop().create_task(self._dispatch(ident, frame))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, ident: bytes, frame: bytes) -> None:
        rid = None
        try:
            rid, op, args = msgpack.unpackb(frame)
            reply = [rid, None, await self._handler(ident, op, args)]
        except Exception as e:  # every failure goes back to the inferlet that caused it
            if not isinstance(e, (ValueError, KeyError, LookupError)):
                log.exception("channel op failed")
            reply = [rid, type(e).__name__, str(e)]
        await self._sock.send_multipart([ident, msgpack.packb(reply)])

    def close(self) -> None:
        self._sock.close(linger=0)
        if path := self.addresses.get("ipc_path"):
            with contextlib.suppress(OSError):
                os.unlink(path)
