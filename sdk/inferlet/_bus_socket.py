"""One inferlet's socket to one message-bus shard (``inferlet.messaging``): a ZeroMQ DEALER read by the event loop,
its operations batched until the loop's turn ends, and a monitor that tells when the shard went away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

FRAME_OPS = 1024  # operations waiting to be sent that make the client send at once rather than at the turn's end
CALL_TIMEOUT_S = 10.0  # how long subscribe waits for the bus to register it
CLOSE_TIMEOUT_S = 2.0  # how long an ending inferlet waits for each shard to confirm its withdrawal


class BusError(RuntimeError):
    """The message bus cannot be reached (no bus configured, or a shard does not answer or refused the inferlet)."""


class ShardConnection:
    """One DEALER socket to one shard, read by the event loop; operations are batched until the turn ends."""

    def __init__(
        self,
        address: str,
        identity: bytes,
        capability: bytes,
        on_events: Callable[[ShardConnection, list], None],
        on_drop: Callable[[ShardConnection], None],
    ):
        self._loop = asyncio.get_running_loop()
        self._on_events = on_events
        self._on_drop = on_drop
        self._capability = capability
        self._outbox: list[list] = []
        self._sock = _zmq_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, identity)
        self._sock.setsockopt(zmq.SNDTIMEO, int(CALL_TIMEOUT_S * 1000))  # backpressure, but never hang for good
        self._sock.setsockopt(zmq.LINGER, int(CLOSE_TIMEOUT_S * 1000))  # give back pulled messages after close
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # the shard went away
        self._sock.connect(address)
        self.address = address
        self._loop.add_reader(self._sock.FD, self.drain)
        self._loop.add_reader(self._monitor.FD, self._watch)
        self._watch()  # its FD is edge-triggered: an edge before the reader was added would never signal again

    def send(self, op: list) -> None:
        self._outbox.append(op)
        if len(self._outbox) >= FRAME_OPS:
            self.flush()
        elif len(self._outbox) == 1:
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        if self._sock.closed:  # a flush scheduled before the inferlet ended
            return
        if self._outbox:
            frame, self._outbox = msgpack.packb(self._outbox), []
            try:
                self._sock.send_multipart([self._capability, frame])  # blocks only while the shard is SNDHWM behind
            except zmq.Again:
                raise BusError(f"message bus shard {self.address} is not accepting messages") from None
        self.drain()

    def drain(self) -> None:
        """Handle every frame that has arrived. ZeroMQ's FD is edge-triggered, so this runs after every send too."""
        while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_events(self, msgpack.unpackb(self._sock.recv(zmq.NOBLOCK)))

    def wait_until(self, done: Callable[[], bool], timeout: float) -> None:
        """Send what is queued and block the loop until ``done()`` (a synchronous call's answer, or a refusal, has
        arrived)."""
        self.flush()
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise BusError(f"message bus shard {self.address} did not answer within {timeout:g} s")
            if self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                self.drain()

    def _watch(self) -> None:
        """The monitor's events (edge-triggered like the socket's): a disconnection means the shard died."""
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED:
                self._on_drop(self)

    def close(self) -> None:
        self._loop.remove_reader(self._sock.FD)
        self._loop.remove_reader(self._monitor.FD)
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()


MAX_SOCKETS = 1 << 16
"""Sockets per process: one per inferlet and shard. ZeroMQ's default cap (1,023) refused the bus to a pooled host
past ~500 inferlets (seen with 1,000 on one node)."""
_zmq: zmq.Context | None = None


def _zmq_context() -> zmq.Context:
    """This process's ZeroMQ context for bus clients, with room for every inferlet's sockets."""
    global _zmq
    if _zmq is None:
        _zmq = zmq.Context()
        _zmq.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return _zmq
