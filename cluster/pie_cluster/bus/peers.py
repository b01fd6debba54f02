"""Who a bus peer is: the capability each message carries, verified once per token, its instance's routing ids,
revocations, and the bound on the peers one instance and one user may hold on a shard.

A shard takes a message's user from here before it reads the message's frame (``shard.py``), so an unproven peer
costs one dict lookup, never a parse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pie_workers.wire.admission import ConnectionLimits, Holders, Revocations
from pie_workers.wire.capability import Capability, CapabilityError, verify

VERIFIED_CACHE = 4096  # capabilities kept verified; past it the cache starts over (a miss costs one HMAC)


@dataclass(frozen=True)
class _Verified:
    """A capability that verified, and the routing ids it may be shown from (those of its instance)."""

    capability: Capability
    routing_prefix: bytes  # ``instance/``


class Peers:
    """The peers of one shard, by the instance and user their capabilities prove."""

    def __init__(self, secret: bytes, limits: ConnectionLimits) -> None:
        self._secret = secret
        self._verified: dict[bytes, _Verified] = {}  # token -> what it proved (a cache, emptied past VERIFIED_CACHE)
        self._holders = Holders(limits)  # routing ids, by the instance and user they are
        self._revoked = Revocations()

    def admit(self, peer: bytes, token: bytes) -> str:
        """The user ``peer`` proves to be with ``token``: a capability for the instance its routing id names
        (verified once per token; its expiry and revocation checked on every frame). Raises ``PermissionError``
        (``CapabilityError``, or a ``ConnectionLimitError`` past the instance's or user's bound of peers)."""
        known = self._verified.get(token)
        if known is None:
            try:
                capability = verify(self._secret, token.decode("ascii"))
            except UnicodeDecodeError:
                raise CapabilityError("malformed capability: not ASCII") from None
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()
            known = self._verified[token] = _Verified(capability, f"{capability.instance}/".encode())
        elif time.time() >= known.capability.expires:
            raise CapabilityError(f"expired capability: instance {known.capability.instance!r} is past its lifetime")
        if not peer.startswith(known.routing_prefix):
            raise CapabilityError(f"the routing id {peer!r} is not one of instance {known.capability.instance!r}")
        self._revoked.check(known.capability)
        self._holders.join(peer, known.capability)
        return known.capability.user

    def leave(self, peer: bytes) -> None:
        self._holders.leave(peer)

    def revoke(self, ended: dict[str, float]) -> list[bytes]:
        """Refuse these instances' capabilities from now on (instance -> its capability's expiry); returns the peers
        they held here."""
        self._revoked.add(ended)
        return [peer for instance in ended for peer in self._holders.of_instance(instance)]
