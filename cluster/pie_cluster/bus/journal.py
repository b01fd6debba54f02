"""The queued messages of one bus shard, journaled on its node's disk so that a restarted shard still has them.

A shard is restarted on its own node (at its addresses), so a file there outlives its process. Every change to a
queue is a record appended to the file: ``["+", user, topic, message]`` (queued at the back), ``["<", user, topic,
messages]`` (given back to the front) and ``["-", user, topic]`` (the front one pulled); and ``["#", peer, seq]``:
the last numbered operation applied for a peer (``seq`` None: the peer left), so that a restart ignores what a
client sends it again. Records are buffered and written with one ``write`` per burst, before the shard sends what
the burst produced, so a message a puller has seen is never handed out again and a push acknowledged is kept; a
write survives the process's death (the kernel has it) though not the machine's, whose loss takes the shard's
address with it anyway. When the file holds many more records than messages are queued, it is rewritten from the
queues; so it is before a write would take it past ``max_bytes`` (``[limits] bus_journal_bytes``, with the queues
held to half of it by ``quotas.py``).
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

Key = tuple[str, str]
COMPACT_AT = 10_000  # records past the queued messages' count that make the file be rewritten


@dataclass
class Replayed:
    """What a journal describes: the queues, and per peer the last numbered operation applied (oldest first)."""

    queues: dict[Key, deque[str]] = field(default_factory=dict)
    applied: OrderedDict[bytes, int] = field(default_factory=OrderedDict)


class Journal:
    def __init__(self, path: Path, max_bytes: int = 2 << 30):
        self._path = path
        self._max_bytes = max_bytes
        self._pending: list[bytes] = []  # records packed, not written yet
        self._pending_bytes = 0
        self._size = 0  # bytes in the file
        self._records = 0  # in the file
        self._queued = 0  # messages the records leave queued
        self._fd = -1
        self._filled: set[Key] = set()  # topics messages were queued on since ``take_filled``

    def take_filled(self) -> set[Key]:
        filled, self._filled = self._filled, set()
        return filled

    def replay(self) -> Replayed:
        """What the file describes (nothing if there is no file); then append to it from there on."""
        state = Replayed()
        if self._path.exists():
            unpacker = msgpack.Unpacker(raw=False)
            data = self._path.read_bytes()
            self._size = len(data)
            unpacker.feed(data)
            for record in unpacker:  # a record cut off by the kill is simply not there
                _apply(state, record)
                self._records += 1
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        state.queues = {key: messages for key, messages in state.queues.items() if messages}
        self._queued = sum(len(messages) for messages in state.queues.values())
        return state

    def queued(self, key: Key, message: str) -> None:
        self._append(["+", *key, message])
        self._queued += 1
        self._filled.add(key)

    def returned(self, key: Key, messages: list[str]) -> None:
        self._append(["<", *key, messages])
        self._queued += len(messages)
        self._filled.add(key)

    def pulled(self, key: Key) -> None:
        self._append(["-", *key])
        self._queued -= 1

    def applied(self, peer: bytes, seq: int | None) -> None:
        self._append(["#", peer, seq])

    def bound(self, state: Callable[[], Replayed]) -> None:
        """Rewrite the file from ``state()`` (which has every change recorded so far) if writing what is pending
        would take it past ``max_bytes``."""
        if self._size + self._pending_bytes > self._max_bytes:
            self._rewrite(state())

    def _append(self, record: list) -> None:
        packed = msgpack.packb(record)
        self._pending.append(packed)
        self._pending_bytes += len(packed)

    def flush(self, state: Callable[[], Replayed]) -> None:
        """Write what this burst changed; rewrite the file from ``state()`` when it has grown far past it."""
        if not self._pending:
            return
        self._records += len(self._pending)
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        os.write(self._fd, data)
        self._size += len(data)
        if self._records > COMPACT_AT + self._queued or self._size > self._max_bytes:
            self._rewrite(state())

    def _rewrite(self, state: Replayed) -> None:
        records = [["<", *key, list(messages)] for key, messages in state.queues.items() if messages]
        records += [["#", peer, seq] for peer, seq in state.applied.items()]
        data = b"".join(msgpack.packb(record) for record in records)
        temporary = self._path.with_suffix(".new")
        temporary.write_bytes(data)
        os.replace(temporary, self._path)
        os.close(self._fd)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self._records, self._size = len(records), len(data)
        self._pending.clear()  # ``state`` has them
        self._pending_bytes = 0

    def remove(self) -> None:
        """The shard is stopped for good: nothing to keep."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._path.unlink(missing_ok=True)


class NoJournal(Journal):
    """Keeps nothing: the queues of a ``Topics`` that need not outlive its process (a shard before it listens, a
    test's own ``Topics``)."""

    def __init__(self) -> None:
        super().__init__(Path())

    def queued(self, key: Key, message: str) -> None:
        pass

    def returned(self, key: Key, messages: list[str]) -> None:
        pass

    def pulled(self, key: Key) -> None:
        pass

    def applied(self, peer: bytes, seq: int | None) -> None:
        pass

    def flush(self, state: Callable[[], Replayed]) -> None:
        pass

    def bound(self, state: Callable[[], Replayed]) -> None:
        pass

    def remove(self) -> None:
        pass


def _apply(state: Replayed, record: list) -> None:
    queues = state.queues
    match record:
        case ["+", str(user), str(topic), str(message)]:
            queues.setdefault((user, topic), deque()).append(message)
        case ["<", str(user), str(topic), list(messages)]:
            queues.setdefault((user, topic), deque()).extendleft(reversed(messages))
        case ["-", str(user), str(topic)]:
            queue = queues.get((user, topic))
            if queue:
                queue.popleft()
        case ["#", bytes(peer), int(seq)]:
            state.applied[peer] = seq
            state.applied.move_to_end(peer)
        case ["#", bytes(peer), None]:
            state.applied.pop(peer, None)
