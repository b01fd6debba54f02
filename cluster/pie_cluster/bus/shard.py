"""One message-bus shard: an async Ray actor that owns a ZeroMQ ROUTER socket and the ``Topics`` behind it.

Wire protocol (msgpack; the client is ``inferlet.messaging``). A peer is one inferlet's DEALER socket; its routing
id is ``instance/session/user``, and the user part namespaces every topic it names. Each frame from a peer is a
list of operations, applied in order::

    ["push", topic, message]     ["pull", topic, rid]    ["cancel", rid]
    ["cast", topic, message]     ["sub", topic, sid]     ["unsub", sid]
    ["requeue", topic, message]  a pulled message its puller no longer wanted: back to the front of the queue
    ["close", token]             drop everything the peer holds (its inferlet ended)

Each frame back is the list of every event the peer has coming from one burst: ``["pulled", rid, topic, message]``,
``["cast", sid, message]``, and ``["ok", id]`` answering ``sub`` (id = sid) and ``close`` (id = token).

The socket is served from the actor's event loop through ``add_reader``: a burst of frames is applied, then each
peer gets one frame — so when many messages are in flight, both directions batch by themselves. The ROUTER is
``ROUTER_MANDATORY``: a frame for a peer that is gone (or has stopped reading for ``SEND_HWM`` frames) fails to
send instead of vanishing, the peer's pulls and subscriptions are dropped, and the pulled messages in that frame go
back to the front of their queues, so a vanished puller does not lose messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import uuid
from dataclasses import dataclass

import msgpack
import ray
import zmq

from pie_cluster.bus.topics import Topics

log = logging.getLogger(__name__)

BURST = 256  # frames applied per turn of the event loop, so the actor's Ray calls (stats, stop) still get a turn
SEND_HWM = 10_000  # frames queued towards one peer before it counts as gone


@dataclass(frozen=True)
class ShardInfo:
    """Where one shard listens: ``ipc`` for inferlets on its node, ``tcp`` for everyone else."""

    index: int
    count: int
    node_id: str
    tcp: str
    ipc: str


class BusShard:
    def __init__(self, index: int, count: int):
        self.index, self.count = index, count
        self._topics = Topics(self._queue_event)
        self._outgoing: dict[bytes, list] = {}
        self._sock: zmq.Socket | None = None
        self._ipc_path = ""
        self._info: ShardInfo | None = None

    async def start(self) -> ShardInfo:
        """Bind and start serving (once; later calls just report where the shard listens)."""
        if self._info is None:
            sock = zmq.Context.instance().socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            ip = ray.util.get_node_ip_address()
            port = sock.bind_to_random_port(f"tcp://{ip}")
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"pie-bus-{uuid.uuid4().hex[:12]}.sock")
            sock.bind(f"ipc://{self._ipc_path}")
            self._sock = sock
            asyncio.get_running_loop().add_reader(sock.FD, self._serve)
            node = ray.get_runtime_context().get_node_id()
            self._info = ShardInfo(self.index, self.count, node, f"tcp://{ip}:{port}", f"ipc://{self._ipc_path}")
        return self._info

    async def stats(self, user: str | None = None) -> dict[str, int]:
        return self._topics.stats(user)

    async def stop(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.FD)
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)

    # -- serving --

    def _serve(self) -> None:
        """Apply a burst of readable frames, then send each peer one frame with all it has coming."""
        sock = self._sock
        if sock is None:
            return
        for _ in range(BURST):
            try:
                peer, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._apply(peer, frame)
        self._send_outgoing()
        # ZeroMQ's FD is edge-triggered: what is still queued after our reads and sends won't signal again.
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            asyncio.get_running_loop().call_soon(self._serve)

    def _apply(self, peer: bytes, frame: bytes) -> None:
        """A malformed frame or operation is the sender's bug: it is logged and skipped, never fatal to the shard."""
        try:
            user = peer.decode().split("/", 2)[2]
            ops = msgpack.unpackb(frame)
        except Exception:
            log.exception("bus shard %d: unreadable frame from %r", self.index, peer)
            return
        for op in ops:
            try:
                self._operate(peer, user, op)
            except Exception:
                log.exception("bus shard %d: bad operation from %r", self.index, peer)

    def _operate(self, peer: bytes, user: str, op: list) -> None:
        topics = self._topics
        match op:
            case ["push", str(topic), str(message)]:
                topics.push((user, topic), message)
            case ["pull", str(topic), int(rid)]:
                topics.pull(peer, user, rid, (user, topic))
            case ["cast", str(topic), str(message)]:
                topics.broadcast((user, topic), message)
            case ["cancel", int(rid)]:
                topics.cancel(peer, rid)
            case ["sub", str(topic), int(sid)]:
                topics.subscribe(peer, user, sid, (user, topic))
                self._queue_event(peer, ["ok", sid])
            case ["unsub", int(sid)]:
                topics.unsubscribe(peer, sid)
            case ["requeue", str(topic), str(message)]:
                topics.requeue((user, topic), [message])
            case ["close", int(token)]:
                topics.drop(peer)
                self._queue_event(peer, ["ok", token])
            case _:
                raise ValueError(f"unknown bus operation {op!r}")

    def _queue_event(self, peer: bytes, event: list) -> None:
        events = self._outgoing.get(peer)
        if events is None:
            self._outgoing[peer] = [event]
        else:
            events.append(event)

    def _send_outgoing(self) -> None:
        while self._outgoing:
            peer, events = self._outgoing.popitem()
            try:
                self._sock.send_multipart([peer, msgpack.packb(events)], zmq.NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
                self._lost(peer, events)

    def _lost(self, peer: bytes, events: list) -> None:
        """Drop a peer that cannot be reached; the messages it was handed go back to the front of their queues."""
        self._topics.drop(peer)
        user = peer.decode().split("/", 2)[2]
        returned: dict[str, list[str]] = {}
        for event in events:
            if event[0] == "pulled":
                returned.setdefault(event[2], []).append(event[3])
        for topic, messages in returned.items():
            self._topics.requeue((user, topic), messages)
