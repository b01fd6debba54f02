"""Messaging between inferlets: queues (push/pull) and topics (broadcast/subscribe) on the cluster's message bus.

    messaging.push(topic, message)          queue a message for exactly one puller
    await messaging.pull(topic) -> str      wait for the next queued message
    messaging.broadcast(topic, message)     deliver to every subscription open on the topic
    messaging.subscribe(topic) -> Subscription
        await sub.next() -> str | None      None once unsubscribed
        async for message in sub: ...       every message until unsubscribe
        sub.unsubscribe();  sub.dropped     messages lost to overflow

Topics belong to the user running the inferlet: alice's "jobs" and bob's "jobs" never meet. Messages are strings.

Delivery rules:

* push/pull — every message is received by exactly one pull; a topic's messages are received in the order the bus
  got them (one inferlet's pushes keep their order), and waiting pulls are served longest-waiting first. Queued
  messages wait on the bus until pulled. A pull that is cancelled (its task cancelled, ``asyncio.wait_for`` timed
  out, its inferlet ended) withdraws from the bus, or, if the bus had already answered it, gives the message back to
  the front of the queue, where it may be received after a later message (the one other such case is below).
* Hand-off in one process — a push whose topic has a pull waiting in the same process (one user's inferlets on a
  node share one) is handed to the longest-waiting of those pulls at once, without a round trip to the bus, as long
  as the pushing inferlet has sent no earlier push on that topic through the bus (so its own pushes keep their
  order). Pulls waiting in that process come first, before longer-waiting ones elsewhere. A message the bus had
  already sent to a pull served this way goes back to the front of the queue like a cancelled pull's: so when a
  topic has pushers in the puller's process and elsewhere too, a message from elsewhere may be received after one
  pushed behind it.
* broadcast/subscribe — ``subscribe`` returns once the bus has registered the subscription, so every broadcast that
  reaches the bus afterwards is delivered to it (nothing is kept for later subscribers). Overflow rule: a
  subscription buffers at most ``SUBSCRIPTION_BUFFER`` unread messages; when another arrives, the *oldest* unread one
  is dropped and counted in ``sub.dropped`` — a reader that falls behind skips ahead instead of stalling the bus or
  missing what is newest.
* ``push`` and ``broadcast`` return at once: operations are sent at the end of the current event-loop turn, many to
  a frame, in call order. When the inferlet ends — by returning, raising or being cancelled — its pulls and
  subscriptions are withdrawn from the bus.
* Limits — the cluster bounds a message's size and the bytes each user has queued on each shard (``[limits]``). A
  shard refuses a push or broadcast past them and queues nothing of it (no message already queued, anyone's, is
  dropped); since ``push`` returned already, the refusal is raised as ``QuotaExceeded`` by the inferlet's next call
  on the bus, or when it ends.

How it travels: ``runtime.current().bus`` holds one address per bus shard (ZeroMQ ROUTER sockets owned by named Ray
actors; see ``pie_cluster.bus``); a topic lives on shard ``crc32(user, topic) % shards``. The inferlet opens one
DEALER socket per shard it uses, served by its event loop; frames are msgpack lists of operations and events, each
sent with the instance's capability, from which the shard takes the user. A shard that refuses the capability says
why, and every call of the inferlet's on the bus then fails with a ``BusError`` saying so. A shard that dies is
restarted at its address with the messages queued on it, and the connection reconnects by itself; the inferlet's
pulls waiting there and its subscriptions there fail with a ``BusError`` saying so when the connection drops.
A shard that does not come back (its node was lost) makes every call on its topics fail with a ``BusError`` once
it has been unreachable for ``UNREACHABLE_S``. Pushed messages are kept by the client until the shard confirms it
journaled them, and sent again to its restart (``inferlet._bus_socket``): each is queued exactly once. An inferlet
that ends waits for that confirmation; one the bus never gives ends it with a ``BusError`` saying how many messages
may be lost.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import zlib

from inferlet import _bus_socket, runtime
from inferlet._bus_socket import CALL_TIMEOUT_S, CLOSE_TIMEOUT_S, BusError, ShardConnection
from inferlet._handoff import Handoffs, Pull
from inferlet._subscription import SUBSCRIPTION_BUFFER, Subscription
from inferlet.runtime import QuotaExceeded

__all__ = ["SUBSCRIPTION_BUFFER", "BusError", "Subscription", "broadcast", "pull", "push", "subscribe"]

log = logging.getLogger(__name__)


def push(topic: str, message: str) -> None:
    """Queue ``message`` on ``topic``; exactly one ``pull`` will receive it."""
    _bus().push(_check(topic, message), message)


async def pull(topic: str) -> str:
    """Wait for the next message queued on ``topic``."""
    return await _bus().pull(_check(topic))


def broadcast(topic: str, message: str) -> None:
    """Deliver ``message`` to every subscription open on ``topic``."""
    _bus().send(_check(topic, message), ["cast", topic, message])


def subscribe(topic: str) -> Subscription:
    """Open a subscription to ``topic``; it receives every broadcast that reaches the bus after this returns."""
    return _bus().subscribe(_check(topic))


_HANDOFFS = Handoffs()


class _Bus:
    """One inferlet's side of the bus: its connections (one per shard it uses), pending pulls and subscriptions."""

    def __init__(self, rt: runtime.Runtime):
        self._addresses = rt.bus
        self._user = rt.username
        self._loop = asyncio.get_running_loop()
        self._identity = f"{rt.instance_id}/{rt.session}".encode()  # a shard holds it to the capability's instance
        self._capability = rt.capability.encode()
        self._connections: dict[int, ShardConnection] = {}
        self._ids = itertools.count()
        self._pulls: dict[int, Pull] = {}
        self._pushed_to_bus: set[str] = set()  # topics this inferlet pushed on through the bus: the later pushes follow
        self._subscriptions: dict[int, Subscription] = {}
        self._answered: set[int] = set()
        self._withdrawals: dict[int, str] = {}  # confirmation token -> topic of a pull served in this process
        self._closed = False
        self._refused: BusError | None = None  # a shard refused the capability: every call fails with this
        self._over: QuotaExceeded | None = None  # a shard refused a message past a limit: the next call raises it

    def send(self, topic: str, op: list) -> None:
        self._raise_over()
        self._connection(topic).send(op)

    def push(self, topic: str, message: str) -> None:
        """Hand ``message`` to a pull waiting in this process, or else queue it on the bus (the module's rules)."""
        self._raise_over()
        connection, key = self._connection(topic), self._local_key(topic)
        if topic not in self._pushed_to_bus:
            while (waiting := _HANDOFFS.take(key)) is not None:
                bus, rid = waiting
                if bus._hand_over(rid, message):
                    return
        self._pushed_to_bus.add(topic)
        if not _HANDOFFS.hold(key, self, message):
            connection.send(["push", topic, message])

    async def pull(self, topic: str) -> str:
        self._raise_over()
        connection = self._connection(topic)
        rid = next(self._ids)
        answer = self._loop.create_future()
        self._pulls[rid] = Pull(topic, answer)
        connection.send(["pull", topic, rid])
        _HANDOFFS.add(self._local_key(topic), self, rid)
        try:
            return await answer
        except asyncio.CancelledError:
            _HANDOFFS.forget(self._local_key(topic), self, rid)
            if self._pulls.pop(rid, None) is not None:  # still waiting on the bus: withdraw (an answer already
                connection.send(["cancel", rid])  # on its way is given back when it arrives)
            elif answer.done() and not answer.cancelled():  # answered in the same turn we were cancelled
                connection.send(["requeue", topic, answer.result()])
            raise

    def _hand_over(self, rid: int, message: str) -> bool:
        """Answer pull ``rid`` with a message pushed in this process, withdrawing it from the bus; False if it is
        being cancelled (its own ``pull`` then cleans up)."""
        pull = self._pulls.get(rid)
        if pull is None or pull.answer.done():
            return False
        del self._pulls[rid]
        token = next(self._ids)
        self._withdrawals[token] = pull.topic
        _HANDOFFS.withdrawing(self._local_key(pull.topic))
        self._connection(pull.topic).send(["withdraw", rid, token])  # what the bus sent it meanwhile goes back
        pull.answer.set_result(message)
        return True

    def _withdrawn(self, token: int) -> None:
        """The shard confirmed a withdrawal (or never will: this client is done); the pushes held for it go out,
        through this client's connection, which is open while its events arrive."""
        topic = self._withdrawals.pop(token)
        released = _HANDOFFS.withdrawn(self._local_key(topic))
        connection = self._connections.get(self._shard(topic))
        for pusher, message in released:
            if self._refused is None and connection is not None:
                connection.send(["push", topic, message])
            else:  # this client was refused: the pusher's own connection, if it still has one
                pusher._send_held(topic, message)

    def _send_held(self, topic: str, message: str) -> None:
        try:
            self._connection(topic).send(["push", topic, message])
        except BusError as e:
            log.warning("a message pushed on %r was lost: %s", topic, e)

    def _local_key(self, topic: str) -> tuple:
        return (self._loop, self._user, topic)

    def subscribe(self, topic: str) -> Subscription:
        self._raise_over()
        connection = self._connection(topic)
        sid = next(self._ids)
        subscription = Subscription(topic, lambda s: self._unsubscribe(s, sid))
        self._subscriptions[sid] = subscription
        connection.send(["sub", topic, sid])
        self._call(connection, sid)
        return subscription

    def close(self) -> None:
        """Withdraw every pull and subscription from every shard; pulled messages nobody took go back."""
        if self._closed:
            return
        self._closed = True
        for rid, pull in self._pulls.items():
            _HANDOFFS.forget(self._local_key(pull.topic), self, rid)
            pull.answer.cancel()
        self._pulls.clear()
        for subscription in self._subscriptions.values():
            subscription._end()
        self._subscriptions.clear()
        unconfirmed = [left for connection in self._connections.values() if (left := self._leave(connection))]
        self._connections.clear()
        for token in list(self._withdrawals):  # unconfirmed (a shard did not answer): release what they held
            self._withdrawn(token)
        if unconfirmed:
            raise BusError(
                f"messages this inferlet pushed may be lost, the bus never confirmed them: {', '.join(unconfirmed)}"
            )
        self._raise_over()

    def _leave(self, connection: ShardConnection) -> str:
        """Withdraw from one shard and close the connection once the shard confirmed every push (a shard that went
        away meanwhile holds nothing of ours but those: its restart need only confirm them). Returns what was never
        confirmed, if anything."""
        token, drops = next(self._ids), connection.drops
        connection.send(["close", token])

        def left() -> bool:
            gone = connection.drops > drops and not connection.unacked
            return token in self._answered or gone or self._refused is not None

        try:
            connection.wait_until(left, CALL_TIMEOUT_S if connection.unacked else CLOSE_TIMEOUT_S)
            connection.flush()  # the messages given back while closing
        except BusError as e:
            log.warning("leaving the message bus: %s", e)
        self._answered.discard(token)
        connection.close()
        return f"{len(connection.unacked)} on shard {connection.address}" if connection.unacked else ""

    def move(self, addresses: tuple[str, ...]) -> None:
        """The shards listen at ``addresses`` now (``Runtime.move_bus``)."""
        self._addresses = addresses
        for shard, connection in self._connections.items():
            if connection.address != addresses[shard]:
                connection.move_to(addresses[shard])

    # -- internals --

    def _raise_over(self) -> None:
        """Raise the refusal of a message this inferlet sent earlier, once."""
        if self._over is not None:
            error, self._over = self._over, None
            raise error

    def _connection(self, topic: str) -> ShardConnection:
        if self._refused is not None:
            raise self._refused
        if self._closed:
            raise BusError("this inferlet has ended: its message bus connection is closed")
        shard = self._shard(topic)
        connection = self._connections.get(shard)
        if connection is not None and connection.unreachable:
            raise _unreachable(connection)
        if connection is None:
            connection = ShardConnection(
                self._addresses[shard], self._identity, self._capability, self._on_events, self._dropped
            )
            self._connections[shard] = connection
        return connection

    def _shard(self, topic: str) -> int:
        return zlib.crc32(f"{self._user}\0{topic}".encode()) % len(self._addresses)

    def _call(self, connection: ShardConnection, token: int) -> None:
        connection.wait_until(lambda: token in self._answered or self._refused is not None, CALL_TIMEOUT_S)
        if self._refused is not None:
            raise self._refused
        self._answered.discard(token)

    def _unsubscribe(self, subscription: Subscription, sid: int) -> None:
        if self._subscriptions.pop(sid, None) is not None:
            self._connection(subscription.topic).send(["unsub", sid])

    def _on_events(self, connection: ShardConnection, events: list) -> None:
        for event in events:
            kind = event[0]
            if kind == "pulled":
                _, rid, topic, message = event
                pull = self._pulls.pop(rid, None)
                if pull is not None and not pull.answer.done():
                    _HANDOFFS.forget(self._local_key(topic), self, rid)
                    pull.answer.set_result(message)
                else:  # its pull was cancelled, or served in this process, meanwhile: give the message back
                    connection.send(["requeue", topic, message])
            elif kind == "cast":
                subscription = self._subscriptions.get(event[1])
                if subscription is not None:
                    subscription._deliver(event[2])
            elif kind == "ok":
                if event[1] in self._withdrawals:
                    self._withdrawn(event[1])
                else:
                    self._answered.add(event[1])
            elif kind == "lost":  # the shard restarted on another node without the messages of this pull's topic
                _, rid, why = event
                pull = self._pulls.pop(rid, None)
                if pull is not None:
                    _HANDOFFS.forget(self._local_key(pull.topic), self, rid)
                    if not pull.answer.done():
                        pull.answer.set_exception(BusError(why))
            elif kind == "acked":
                connection.acked(event[1])
            elif kind == "resend":
                connection.resend(event[1])
            elif kind == "over":  # a message past a limit: nothing of it was queued
                self._over = self._over or QuotaExceeded(f"the message bus refused a message: {event[1]}")
            elif kind == "refused":
                self._refuse(BusError(f"message bus shard {connection.address} refused this inferlet: {event[1]}"))

    def _dropped(self, connection: ShardConnection) -> None:
        """The shard behind ``connection`` died with what it held, or has since been unreachable too long: the
        pulls and subscriptions this inferlet had there fail (the connection goes on to its restarted shard)."""
        error = _unreachable(connection) if connection.unreachable else _went_away(connection)
        shard = next(i for i, c in self._connections.items() if c is connection)
        for rid, pull in list(self._pulls.items()):
            if self._shard(pull.topic) == shard:
                del self._pulls[rid]
                _HANDOFFS.forget(self._local_key(pull.topic), self, rid)
                if not pull.answer.done():
                    pull.answer.set_exception(error)
        for sid, subscription in list(self._subscriptions.items()):
            if self._shard(subscription.topic) == shard:
                del self._subscriptions[sid]
                subscription._fail(error)
        for token, topic in list(self._withdrawals.items()):
            if self._shard(topic) == shard:  # never to be confirmed
                self._withdrawn(token)

    def _refuse(self, error: BusError) -> None:
        """The capability was refused (it will be by every shard): pending pulls fail, and so does what follows."""
        self._refused = error
        for token in list(self._withdrawals):  # never to be confirmed: what they held goes out another way
            self._withdrawn(token)
        pulls, self._pulls = self._pulls, {}
        for rid, pull in pulls.items():
            _HANDOFFS.forget(self._local_key(pull.topic), self, rid)
            if not pull.answer.done():
                pull.answer.set_exception(error)


def _went_away(connection: ShardConnection) -> BusError:
    return BusError(
        f"message bus shard {connection.address} went away: this pull or subscription was lost with it, with any "
        "message the shard was sending it at that instant (the shard is restarted with its queued messages; pull "
        "again, subscribe again)"
    )


def _unreachable(connection: ShardConnection) -> BusError:
    return BusError(
        f"message bus shard {connection.address} has not been reachable for {_bus_socket.UNREACHABLE_S:g} s (its "
        "node may be lost): calls on its topics fail until it is back"
    )


def _bus() -> _Bus:
    rt = runtime.current()
    if rt.bus_client is None:
        if not rt.bus:
            raise BusError("no message bus is configured for this inferlet (its runtime has no bus addresses)")
        rt.bus_client = _Bus(rt)  # kept once closed: a task left behind gets an error, not a new client
        rt.on_close(rt.bus_client.close)
    return rt.bus_client


def _check(topic: str, message: str = "") -> str:
    if not isinstance(topic, str) or not topic:
        raise TypeError(f"a topic is a non-empty string, not {topic!r}")
    if not isinstance(message, str):
        raise TypeError(f"a message is a string, not {type(message).__name__} (encode it, e.g. with json.dumps)")
    return topic
