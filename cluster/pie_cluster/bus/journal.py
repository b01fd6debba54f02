"""The queued messages of one bus shard, journaled on its node's disk so that a restarted shard still has them.

A shard is restarted on its own node (at its addresses), so a file there outlives its process. Every change to a
queue is a record appended to the file: ``["+", user, topic, message]`` (queued at the back), ``["<", user, topic,
messages]`` (given back to the front) and ``["-", user, topic]`` (the front one pulled). Records are buffered and
written with one ``write`` per burst, before the shard sends what the burst produced, so a message a puller has
seen is never handed out again; a write survives the process's death (the kernel has it) though not the machine's,
whose loss takes the shard's address with it anyway. When the file holds many more records than messages are
queued, it is rewritten from the queues.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgpack

Key = tuple[str, str]
COMPACT_AT = 10_000  # records past the queued messages' count that make the file be rewritten


class Journal:
    def __init__(self, path: Path):
        self._path = path
        self._pending: list[list] = []
        self._records = 0  # in the file
        self._queued = 0  # messages the records leave queued
        self._fd = -1

    def replay(self) -> dict[Key, deque[str]]:
        """The queues the file describes (none if there is no file); then append to it from there on."""
        queues: dict[Key, deque[str]] = {}
        if self._path.exists():
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(self._path.read_bytes())
            for record in unpacker:  # a record cut off by the kill is simply not there
                _apply(queues, record)
                self._records += 1
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        kept = {key: messages for key, messages in queues.items() if messages}
        self._queued = sum(len(messages) for messages in kept.values())
        return kept

    def queued(self, key: Key, message: str) -> None:
        self._pending.append(["+", *key, message])
        self._queued += 1

    def returned(self, key: Key, messages: list[str]) -> None:
        self._pending.append(["<", *key, messages])
        self._queued += len(messages)

    def pulled(self, key: Key) -> None:
        self._pending.append(["-", *key])
        self._queued -= 1

    def flush(self, queues: Callable[[], dict[Key, deque[str]]]) -> None:
        """Write what this burst changed; rewrite the file from ``queues()`` when it has grown far past them."""
        if not self._pending:
            return
        self._records += len(self._pending)
        data = b"".join(msgpack.packb(record) for record in self._pending)
        self._pending.clear()
        os.write(self._fd, data)
        if self._records > COMPACT_AT + self._queued:
            self._rewrite(queues())

    def _rewrite(self, queues: dict[Key, deque[str]]) -> None:
        records = [["<", *key, list(messages)] for key, messages in queues.items() if messages]
        temporary = self._path.with_suffix(".new")
        temporary.write_bytes(b"".join(msgpack.packb(record) for record in records))
        os.replace(temporary, self._path)
        os.close(self._fd)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self._records = len(records)

    def remove(self) -> None:
        """The shard is stopped for good: nothing to keep."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._path.unlink(missing_ok=True)


def _apply(queues: dict[Key, deque[str]], record: list) -> None:
    match record:
        case ["+", str(user), str(topic), str(message)]:
            queues.setdefault((user, topic), deque()).append(message)
        case ["<", str(user), str(topic), list(messages)]:
            queues.setdefault((user, topic), deque()).extendleft(reversed(messages))
        case ["-", str(user), str(topic)]:
            queue = queues.get((user, topic))
            if queue:
                queue.popleft()
