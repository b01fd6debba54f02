"""Who a bus peer is: the capability each message carries, verified once per token, its instance's routing ids,
revocations, and the bound on the peers one instance and one user may hold on a shard.

A shard takes a message's user from here before it reads the message's frame (``shard.py``), so an unproven peer
costs one dict lookup, never a parse.
"""

from __future__ import annotations

from pie_workers.wire.admission import ConnectionLimits, Holders, Revocation, Verifier
from pie_workers.wire.capability import CapabilityError


class Peers:
    """The peers of one shard, by the instance and user their capabilities prove."""

    def __init__(self, secret: bytes, limits: ConnectionLimits) -> None:
        self._verifier = Verifier(secret)
        self._holders = Holders(limits)  # routing ids, by the instance and user they are

    def admit(self, peer: bytes, token: bytes) -> str:
        """The user ``peer`` proves to be with ``token``: a capability for the instance its routing id names
        (verified once per token; its expiry and revocation checked on every frame). Raises ``PermissionError``
        (``CapabilityError``, or a ``ConnectionLimitError`` past the instance's or user's bound of peers)."""
        try:
            capability = self._verifier.verify(token.decode("ascii"))
        except UnicodeDecodeError:
            raise CapabilityError("malformed capability: not ASCII") from None
        if not peer.startswith(f"{capability.instance}/".encode()):
            raise CapabilityError(f"the routing id {peer!r} is not one of instance {capability.instance!r}")
        self._holders.join(peer, capability)
        return capability.user

    def leave(self, peer: bytes) -> None:
        self._holders.leave(peer)

    def revoke(self, revocation: Revocation) -> list[bytes]:
        """Refuse the capabilities of the minter's instances that ended from now on; returns the peers they held
        here."""
        return [peer for instance in self._verifier.revoke(revocation) for peer in self._holders.of_instance(instance)]
