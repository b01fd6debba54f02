"""Capabilities end with their instance: the trusted side that ends instances tells every replica and bus shard.

A capability lives until its expiry, which for an instance without a deadline is long (``CAPABILITY_TTL_S``); after
its instance ended it would otherwise still open connections, hold them, and reach every replica and shard. The
node hosts (``hosts/node_host.py``) and the ingress (``ingress/own_programs.py``) note each capability they mint
and, when its instance ends, send its revocation. What ended in one event-loop turn goes to each replica and shard as
one Ray call (``revoke``, fire and forget: a target that is down loses nothing it still holds, and one restarted
anew knows no connection of the instance), never one call per instance or per token (DESIGN rule 2). Each target
keeps the revocation until the capability would have expired anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class Revoker:
    """The capabilities one trusted process minted, and their revocation once their instances end."""

    def __init__(self, targets: Callable[[], Iterable]) -> None:
        """``targets``: the actors to tell (every replica's leader and every bus shard, as the cluster's services
        say now); each has ``revoke(dict[instance, expiry])``."""
        self._targets = targets
        self._expiry: dict[str, float] = {}  # instance -> when its capability expires
        self._ended: dict[str, float] = {}  # revoked this turn, not sent yet

    def minted(self, instance_id: str, ttl_s: float) -> None:
        self._expiry[instance_id] = time.time() + ttl_s + 1.0  # (a moment past the token's own expiry)

    def ended(self, instance_ids: Iterable[str]) -> None:
        """These instances ended: their capabilities are revoked everywhere, at the end of this loop turn."""
        first = not self._ended
        for instance_id in instance_ids:
            expires = self._expiry.pop(instance_id, None)
            if expires is not None:
                self._ended[instance_id] = expires
        if first and self._ended:
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        batch, self._ended = self._ended, {}
        for target in self._targets():
            try:
                target.revoke.remote(batch)
            except Exception:  # a handle of an actor gone for good: the rest are still told
                log.warning("could not send revocations to %s", target, exc_info=True)
