"""One inferlet's socket to one message-bus shard (``inferlet.messaging``): a ZeroMQ DEALER read by the event loop,
its operations batched until the loop's turn ends, and a monitor that tells when the shard went away.

Operations that hand the shard a message (``push``, ``requeue``) are numbered and kept until the shard acknowledges
them (``["acked", seq]``, sent once its journal has them): a shard that dies before it read them would otherwise
lose them without anyone knowing. When the connection drops, the unacknowledged ones are sent again to the
restarted shard; a shard that sees a gap in the numbers asks for them again (``["resend", seq]``) and ignores the
ones it already applied, so each is applied exactly once and in order. Each carries the lowest number still
unacknowledged, so a shard that no longer knows the peer knows where it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

FRAME_OPS = 1024  # operations waiting to be sent that make the client send at once rather than at the turn's end
CALL_TIMEOUT_S = 10.0  # how long subscribe waits for the bus to register it
CLOSE_TIMEOUT_S = 2.0  # how long an ending inferlet waits for each shard to confirm its withdrawal
UNREACHABLE_S = 30.0  # a shard not connected this long is unreachable: calls on it fail until it connects again
HEARTBEAT_S = 5.0  # ZeroMQ pings the shard this often over an idle connection ...
HEARTBEAT_TIMEOUT_S = 15.0  # ... and drops it (then connects again) when nothing came back for this long
NUMBERED = ("push", "requeue")  # operations that hand the shard a message: kept until it acknowledges them


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
        self._sent = 0  # numbered operations so far
        self.unacked: deque[tuple[int, list]] = deque()  # (number, operation), oldest first
        self.drops = 0  # times the shard went away
        self.connected = False
        self.unreachable = False  # not connected for UNREACHABLE_S (its node may be lost): calls on it fail
        self._unreachable_check = self._loop.call_later(UNREACHABLE_S, self._check_reachable)
        self._sock = _zmq_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, identity)
        self._sock.setsockopt(zmq.SNDTIMEO, int(CALL_TIMEOUT_S * 1000))  # backpressure, but never hang for good
        self._sock.setsockopt(zmq.LINGER, int(CLOSE_TIMEOUT_S * 1000))  # give back pulled messages after close
        # a node lost without closing its connections (no TCP reset) is noticed by the pings; the connection then
        # goes through its relay again to wherever the shard was restarted
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        # connected once the shard answered the handshake: a relay accepts a connection before it found the shard
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self.address = address
        self._loop.add_reader(self._sock.FD, self.drain)
        self._loop.add_reader(self._monitor.FD, self._watch)
        self._watch()  # its FD is edge-triggered: an edge before the reader was added would never signal again

    def send(self, op: list) -> None:
        if op[0] in NUMBERED:
            self._sent += 1
            op = [*op, self._sent, self.unacked[0][0] if self.unacked else self._sent]
            self.unacked.append((self._sent, op))
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

    def acked(self, seq: int) -> None:
        """The shard has journaled every numbered operation up to ``seq``."""
        while self.unacked and self.unacked[0][0] <= seq:
            self.unacked.popleft()

    def resend(self, first: int) -> None:
        """Send again every unacknowledged operation from number ``first`` on (the shard never read them)."""
        if not self.unacked:
            return
        lowest = self.unacked[0][0]
        for seq, op in self.unacked:
            if seq >= first:
                op[-1] = lowest  # where a shard that no longer knows this peer should start
                self._outbox.append(op)
        if self._outbox:
            self._loop.call_soon(self.flush)

    def move_to(self, address: str) -> None:
        """Connect to the shard at ``address`` instead (it was made again elsewhere): what was not acknowledged goes
        again, there (what was queued towards the old address is dropped with it)."""
        with contextlib.suppress(zmq.ZMQError):  # not connected there any more
            self._sock.disconnect(self.address)
        self._sock.connect(address)
        self.address = address
        if self.unacked:
            self.resend(self.unacked[0][0])

    def wait_until(self, done: Callable[[], bool], timeout: float) -> None:
        """Send what is queued and block the loop until ``done()`` (a synchronous call's answer, or a refusal, has
        arrived), watching for the shard going away meanwhile."""
        self.flush()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise BusError(f"message bus shard {self.address} did not answer within {timeout:g} s")
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self._monitor in ready:
                self._watch()
            self.flush()  # what the watch queued to send again
            if self._sock in ready:
                self.drain()

    def _watch(self) -> None:
        """The monitor's events (edge-triggered like the socket's): a disconnection means the shard died. What it
        had not acknowledged goes again, to its restart, which ignores what it already applied; a restart that does
        not come within ``UNREACHABLE_S`` makes the shard unreachable."""
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.unreachable = True, False
                self._unreachable_check.cancel()
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self.drops += 1
                if self.unacked:
                    self.resend(self.unacked[0][0])
                self._unreachable_check = self._loop.call_later(UNREACHABLE_S, self._check_reachable)
                self._on_drop(self)

    def _check_reachable(self) -> None:
        if not self.connected and not self._sock.closed:
            self.unreachable = True
            self._on_drop(self)

    def close(self) -> None:
        self._unreachable_check.cancel()
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
