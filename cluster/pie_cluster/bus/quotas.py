"""What one bus shard lets each user put on it (``[limits]``: ``BusLimits``), checked where a message arrives.

* ``bus_message_bytes``: one pushed or broadcast message (UTF-8 bytes).
* ``bus_queued_bytes_per_user``: the messages queued for one user on this shard. Only what would wait in a queue
  counts (a push handed straight to a waiting pull does not); messages given back by a pull (``requeue``) are never
  refused, since they were counted when pushed.
* ``bus_journal_bytes``: the shard's journal on its node's disk. The journal is compacted before a write would take
  it past the bound (``journal.py``), and the messages queued on the shard, every user's together, are held to half
  of it, so a compacted journal always has room and compacting costs O(1) per byte written.

A push past one of them is not queued: it is answered ``["over", why]`` (and still acknowledged, so the pusher's
numbering goes on), and the pushing inferlet gets a ``QuotaExceeded`` naming the limit; nothing queued, whoever's,
is dropped. Subscription buffers live in the subscribing inferlets, so a shard holds no broadcast beyond the burst
that delivers it.
"""

from __future__ import annotations

from pie_cluster.bus.topics import Key, Topics, message_bytes
from pie_cluster.limits import BusLimits


def refusal(limits: BusLimits, topics: Topics, key: Key, message: str, push: bool = True) -> str | None:
    """Why ``message`` may not be pushed (``push``; else broadcast) on ``key``; None: it may."""
    size = message_bytes(message)
    if size > limits.message_bytes:
        return (
            f"a message of {size} bytes is over this cluster's limit: [limits] bus_message_bytes = "
            f"{limits.message_bytes}"
        )
    if not push or not topics.would_queue(key):
        return None
    user, held = key[0], topics.queued_bytes(key[0])
    if held + size > limits.queued_bytes_per_user:
        return (
            f"user {user!r} has {held} bytes of messages queued on this bus shard, and this one has {size}: [limits] "
            f"bus_queued_bytes_per_user = {limits.queued_bytes_per_user} (pull some first)"
        )
    if topics.total_bytes + size > limits.journal_bytes // 2:
        return (
            f"this bus shard's queues are full ({topics.total_bytes} bytes, every user's): [limits] bus_journal_bytes "
            f"= {limits.journal_bytes} bounds its journal on disk, and queued messages to half of that"
        )
    return None
