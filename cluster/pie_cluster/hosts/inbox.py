"""An instance's inbox: what its client sent (session messages and files) until the instance receives it.

Kept on the trusted host that runs the instance, whose memory every user's instances there share, so it is bounded:
per instance (``[limits] inbox_bytes``) and per user on the host (``inbox_bytes_per_user``). Without the bounds a
client holding a token could fill the host with files its own instance never reads. A put past either is refused
with ``InboxFull`` (HTTP 429): the client may send again once the instance has received what waits.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pie_cluster.hosts.event_limits import size_of
from pie_cluster.limits import ChannelLimits
from pie_cluster.overloaded import Overloaded

KINDS = ("message", "file")


class InboxFull(Overloaded):
    """An instance's inbox, or its user's inboxes on one host, hold all they may; retry once it has received."""


@dataclass
class Inbox:
    """One queue per kind, and the bytes waiting in them."""

    queues: dict[str, asyncio.Queue] = field(default_factory=lambda: {kind: asyncio.Queue() for kind in KINDS})
    queued_bytes: int = 0

    def put(self, kind: str, value: str | bytes) -> None:
        self.queues[kind].put_nowait(value)
        self.queued_bytes += size_of(value)

    async def get(self, kind: str) -> str | bytes:
        value = await self.queues[kind].get()
        self.queued_bytes -= size_of(value)
        return value


def check_room(instance_id: str, inbox: Inbox, user_queued: int, size: int, limits: ChannelLimits) -> None:
    """Raises ``InboxFull`` naming the bound a value of ``size`` bytes would pass. ``user_queued``: the bytes
    waiting in all of its user's inboxes on this host."""
    if inbox.queued_bytes + size > limits.inbox_bytes:
        raise InboxFull(
            f"instance {instance_id} has {inbox.queued_bytes} bytes it has not received yet; {size} more would pass "
            f"its inbox's limit of {limits.inbox_bytes} bytes ([limits] inbox_bytes)"
        )
    if user_queued + size > limits.inbox_bytes_per_user:
        raise InboxFull(
            f"this user's instances on their host have {user_queued} bytes they have not received yet; {size} more "
            f"would pass the limit of {limits.inbox_bytes_per_user} bytes ([limits] inbox_bytes_per_user)"
        )
