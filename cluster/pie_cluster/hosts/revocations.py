"""Capabilities end with their instance: the trusted process that minted one tells every replica and bus shard.

A capability lives until its expiry, which for an instance without a deadline is long (``CAPABILITY_TTL_S``); after
its instance ended it would otherwise still open connections, hold them, and reach every replica and shard. Each
trusted process that mints capabilities (the node hosts, ``hosts/node_host.py``; the ingress replicas,
``ingress/own_programs.py``) is one *minter*: it numbers what it mints (``Minting``, signed into the capability) and
tells every replica and shard (``revoke``, fire and forget, DESIGN rule 2):

* what ended in one event-loop turn, as one call per target, never one per instance or token;
* every ``STANDING_S``, its standing: everything it minted below its next number but its live set has ended.

So a target keeps per minter its live set and a few seconds of endings, not an entry for every instance that ended
in the last week (one per OpenAI request at any rate of them), and a target that restarts, or missed a call, learns
what ended from the next standing, within ``STANDING_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable

from pie_workers.wire.admission import STANDING_S, Revocation
from pie_workers.wire.capability import Minting

log = logging.getLogger(__name__)


class Revoker:
    """One minter: the capabilities its process minted, in order, and what every target must know of them."""

    def __init__(self, targets: Callable[[], Iterable]) -> None:
        """``targets``: the actors to tell (every replica's leader and every bus shard, as the cluster's services
        say now); each has ``revoke(Revocation)``."""
        self._targets = targets
        self.minter = uuid.uuid4().hex[:16]  # this process's incarnation: a restarted host is a new minter
        self._next_seq = 0
        self._live: dict[str, tuple[int, float]] = {}  # instance -> (its seq, when its capability expires)
        self._ended: dict[str, tuple[float, int]] = {}  # ended this turn, not sent yet: instance -> (expiry, seq)
        self._standing: asyncio.Task | None = None

    def minted(self, instance_id: str, ttl_s: float) -> Minting:
        """A capability for ``instance_id`` is being minted with ``ttl_s``: its place in this minter's order."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._live[instance_id] = (seq, time.time() + ttl_s + 1.0)  # (a moment past the token's own expiry)
        if self._standing is None:
            self._standing = asyncio.get_running_loop().create_task(self._stand())
        return Minting(self.minter, seq)

    def ended(self, instance_ids: Iterable[str]) -> None:
        """These instances ended: their capabilities are revoked everywhere, at the end of this loop turn."""
        first = not self._ended
        for instance_id in instance_ids:
            minted = self._live.pop(instance_id, None)
            if minted is not None:
                seq, expires = minted
                self._ended[instance_id] = (expires, seq)
        if first and self._ended:
            asyncio.get_running_loop().call_soon(self._send_endings)

    def standing(self) -> Revocation:
        """Everything minted so far but the live set has ended (capabilities past their expiry leave the set)."""
        now = time.time()
        self._live = {i: (seq, expires) for i, (seq, expires) in self._live.items() if expires > now}
        return Revocation(self.minter, floor=self._next_seq, live=frozenset(seq for seq, _ in self._live.values()))

    def _send_endings(self) -> None:
        batch, self._ended = self._ended, {}
        self._send(Revocation(self.minter, ended=batch))

    async def _stand(self) -> None:
        while True:
            await asyncio.sleep(STANDING_S)
            self._send(self.standing())

    def _send(self, revocation: Revocation) -> None:
        for target in self._targets():
            try:
                target.revoke.remote(revocation)
            except Exception:  # a handle of an actor gone for good: the rest are still told
                log.warning("could not send revocations to %s", target, exc_info=True)
