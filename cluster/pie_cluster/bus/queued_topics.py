"""Which of a shard's topics may hold messages, recorded in the GCS's key-value store: what a shard restarted on
another node reports as lost.

A shard's journal is on its node's disk (``journal.py``), so the node's loss takes its queued messages. Its restart
elsewhere cannot bring them back, but it must not lose them silently either: the first pull on each topic that
held messages fails with an error saying so (``["lost", rid, why]``). A topic is recorded before any push that
queued on it is acknowledged (one GCS write per burst that fills a topic not yet recorded), and dropped from the
record once a second when it holds nothing, so a pull is told of a loss that may not have been one only where its
topic emptied within the last second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pie_cluster.gcs_store import GcsStore

Key = tuple[str, str]
SHRINK_S = 1.0  # how often topics that hold nothing leave the record
_RECORD = ("queued",)


class QueuedTopics:
    def __init__(self, stored: GcsStore, lost_with: GcsStore | None):
        """``lost_with``: the record of the shard this one replaces, whose node was lost with its messages."""
        self._stored = stored
        self._recorded: set[Key] = {tuple(key) for key in stored.get(_RECORD) or ()}
        self._lost: set[Key] = set()  # each reported to its first pull
        if lost_with is not None:
            self._lost = {tuple(key) for key in lost_with.get(_RECORD) or ()}
            self._recorded |= self._lost
            self._write()
            lost_with.clear()

    @property
    def lost(self) -> int:
        return len(self._lost)

    def cover(self, filled: Iterable[Key]) -> None:
        """Record the topics a burst queued messages on, before its pushes are acknowledged."""
        new = [key for key in filled if key not in self._recorded]
        if new:
            self._recorded.update(new)
            self._write()

    def shrink(self, holds: Callable[[Key], bool]) -> None:
        """Forget the topics that hold nothing now (those lost and not yet reported stay)."""
        kept = {key for key in self._recorded if key in self._lost or holds(key)}
        if kept != self._recorded:
            self._recorded = kept
            self._write()

    def take_lost(self, key: Key) -> bool:
        """Whether ``key``'s messages were lost and no pull was told yet (this one is)."""
        if key not in self._lost:
            return False
        self._lost.discard(key)
        return True

    def _write(self) -> None:
        self._stored.put(_RECORD, sorted(self._recorded))
