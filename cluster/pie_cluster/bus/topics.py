"""What one bus shard holds: per (user, topic) a FIFO message queue with FIFO pullers and a set of subscribers, and
per peer (one inferlet's connection) the pulls and subscriptions it holds, so a peer that leaves is dropped in one
call. Pure bookkeeping — no sockets — so every rule here is exercised directly by the shard and its tests.

Outgoing messages leave through ``emit(peer, user, event)`` (``user``: whose topic it comes from, which is always
the peer's own); events are ``["pulled", rid, topic, message]`` (the answer to one pull) and ``["cast", sid,
message]`` (a broadcast for one subscription).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

from pie_cluster.bus.journal import Journal, NoJournal

Key = tuple[str, str]  # (user, topic): users never share a key, which is all the namespacing there is
Emit = Callable[[bytes, str, list], None]


@dataclass(frozen=True)
class BusStats:
    """Counts of what a shard holds, or the whole bus (shards' counts added up): the evidence that nothing leaks."""

    sessions: int = 0
    topics: int = 0
    queued: int = 0  # messages
    waiters: int = 0  # pulls waiting for one
    subscriptions: int = 0

    def __add__(self, other: BusStats) -> BusStats:
        return BusStats(*(mine + theirs for mine, theirs in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class _Queue:
    messages: deque[str] = field(default_factory=deque)
    waiters: OrderedDict[tuple[bytes, int], None] = field(default_factory=OrderedDict)  # (peer, rid), oldest first


@dataclass
class _Held:
    """What one peer holds on this shard: its waiting pulls and its subscriptions, each by id."""

    user: str
    pulls: dict[int, Key] = field(default_factory=dict)
    subscriptions: dict[int, Key] = field(default_factory=dict)


class Topics:
    def __init__(self, emit: Emit, journal: Journal | None = None, queued: dict[Key, deque[str]] | None = None):
        """``journal``: told every change to a queue (``journal.py``); ``queued``: what its replay had queued."""
        self._emit = emit
        self._journal = journal if journal is not None else NoJournal()
        self._queues: dict[Key, _Queue] = {key: _Queue(messages) for key, messages in (queued or {}).items()}
        self._subscribers: dict[Key, dict[tuple[bytes, int], None]] = {}
        self._held: dict[bytes, _Held] = {}
        self._bytes: Counter[str] = Counter()  # user -> bytes of their queued messages (``quotas.py``)
        self.total_bytes = 0  # every user's
        for (user, _), messages in (queued or {}).items():
            self._count(user, sum(map(message_bytes, messages)))

    def queued_bytes(self, user: str) -> int:
        return self._bytes[user]

    def would_queue(self, key: Key) -> bool:
        """Whether a message pushed on ``key`` now would wait in its queue (no pull is waiting for it)."""
        queue = self._queues.get(key)
        return queue is None or not queue.waiters

    def holds(self, key: Key) -> bool:
        """Whether messages are queued on ``key``."""
        queue = self._queues.get(key)
        return queue is not None and bool(queue.messages)

    def queued_messages(self) -> dict[Key, deque[str]]:
        return {key: queue.messages for key, queue in self._queues.items() if queue.messages}

    # -- push / pull: each message goes to exactly one puller, oldest message to the longest-waiting puller --

    def push(self, key: Key, message: str) -> None:
        """Hand ``message`` to the oldest waiting puller, else queue it."""
        if not self._hand_to_waiter(key, message):
            self._queues.setdefault(key, _Queue()).messages.append(message)
            self._journal.queued(key, message)
            self._count(key[0], message_bytes(message))

    def requeue(self, key: Key, messages: list[str]) -> None:
        """Messages that were pulled but not taken (oldest first) go back ahead of everything queued after them."""
        rest = [m for m in messages if not self._hand_to_waiter(key, m)]
        if rest:
            self._queues.setdefault(key, _Queue()).messages.extendleft(reversed(rest))
            self._journal.returned(key, rest)
            self._count(key[0], sum(map(message_bytes, rest)))

    def pull(self, peer: bytes, user: str, rid: int, key: Key) -> None:
        queue = self._queues.get(key)
        if queue is not None and queue.messages:
            message = queue.messages.popleft()
            self._journal.pulled(key)
            self._count(key[0], -message_bytes(message))
            self._forget_if_idle(key)
            self._emit(peer, key[0], ["pulled", rid, key[1], message])
            return
        self._queues.setdefault(key, _Queue()).waiters[(peer, rid)] = None
        self._held.setdefault(peer, _Held(user)).pulls[rid] = key

    def cancel(self, peer: bytes, rid: int) -> None:
        """Withdraw a waiting pull; a pull that was already answered is the client's to give back (``requeue``)."""
        key = self._release_pull(peer, rid)
        if key is not None:
            del self._queues[key].waiters[(peer, rid)]
            self._forget_if_idle(key)

    # -- broadcast / subscribe: fan-out to the subscribers present when the broadcast arrives --

    def subscribe(self, peer: bytes, user: str, sid: int, key: Key) -> None:
        self._subscribers.setdefault(key, {})[(peer, sid)] = None
        self._held.setdefault(peer, _Held(user)).subscriptions[sid] = key

    def unsubscribe(self, peer: bytes, sid: int) -> None:
        held = self._held.get(peer)
        key = held.subscriptions.pop(sid, None) if held is not None else None
        if key is None:
            return
        subscribers = self._subscribers[key]
        del subscribers[(peer, sid)]
        if not subscribers:
            del self._subscribers[key]
        self._forget_peer_if_idle(peer)

    def broadcast(self, key: Key, message: str) -> None:
        for peer, sid in self._subscribers.get(key, ()):
            self._emit(peer, key[0], ["cast", sid, message])

    # -- peers --

    def drop(self, peer: bytes) -> None:
        """Forget everything ``peer`` holds: its inferlet ended, or its connection is gone."""
        held = self._held.get(peer)
        if held is None:
            return
        for rid in list(held.pulls):
            self.cancel(peer, rid)
        for sid in list(held.subscriptions):
            self.unsubscribe(peer, sid)

    def stats(self, user: str | None = None) -> BusStats:
        """Counts of what the shard holds (for ``user`` only, if given)."""
        mine = (lambda key: True) if user is None else (lambda key: key[0] == user)
        queues = [q for key, q in self._queues.items() if mine(key)]
        return BusStats(
            sessions=sum(1 for held in self._held.values() if user is None or held.user == user),
            topics=len({key for key in (*self._queues, *self._subscribers) if mine(key)}),
            queued=sum(len(q.messages) for q in queues),
            waiters=sum(len(q.waiters) for q in queues),
            subscriptions=sum(len(s) for key, s in self._subscribers.items() if mine(key)),
        )

    # -- bookkeeping --

    def _hand_to_waiter(self, key: Key, message: str) -> bool:
        queue = self._queues.get(key)
        if queue is None or not queue.waiters:
            return False
        (peer, rid), _ = queue.waiters.popitem(last=False)
        self._release_pull(peer, rid)
        self._forget_if_idle(key)
        self._emit(peer, key[0], ["pulled", rid, key[1], message])
        return True

    def _release_pull(self, peer: bytes, rid: int) -> Key | None:
        held = self._held.get(peer)
        key = held.pulls.pop(rid, None) if held is not None else None
        if key is not None:
            self._forget_peer_if_idle(peer)
        return key

    def _count(self, user: str, size: int) -> None:
        self._bytes[user] += size
        self.total_bytes += size
        if not self._bytes[user]:
            del self._bytes[user]

    def _forget_if_idle(self, key: Key) -> None:
        queue = self._queues[key]
        if not queue.messages and not queue.waiters:
            del self._queues[key]

    def _forget_peer_if_idle(self, peer: bytes) -> None:
        held = self._held[peer]
        if not held.pulls and not held.subscriptions:
            del self._held[peer]


def message_bytes(message: str) -> int:
    """A message's UTF-8 bytes (ASCII counted without encoding)."""
    return len(message) if message.isascii() else len(message.encode())
