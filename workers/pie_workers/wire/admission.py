"""What a replica and a bus shard check of a connection before they serve it, shared by both.

A connection proves who it is before anything it sends is parsed (``engine/channel.py``: a capability handshake;
the bus: a capability on every message, checked before its frame is read). Past that, what one instance or user may
hold open is bounded (``ConnectionLimits``, set by ``[limits]``), so that no tenant can crowd the socket every
tenant's calls go through; an instance that ended is refused from then on (``Revocations``: the trusted side that
minted its capability says so); and what is refused is logged at a bounded rate (``RefusalLog``), since a hostile
client could otherwise fill the log as fast as it can connect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from pie_workers.wire.capability import Capability, CapabilityError, verify


class ConnectionLimitError(PermissionError):
    """The instance or its user holds as many live connections as its limit allows."""


class RevokedError(PermissionError):
    """The capability's instance has ended: the trusted side revoked it. Refused like a forged one at a handshake;
    a request of it on a connection that other instances share fails alone (the connection is theirs too)."""


VERIFIED_CACHE = 4096  # capabilities kept verified; past it the cache starts over (a miss costs one HMAC)


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on connections a replica or bus shard holds (``[limits]``)."""

    per_instance: int = 16  # live authenticated connections carrying one instance
    per_user: int = 4096  # live authenticated connections carrying any instance of one user (a bus peer each)
    waiting_per_peer: int = 64  # connections of one peer (uid or IP) that have not finished their handshake
    handshake_s: float = 5.0  # how long a connection may take to send its handshake before it is closed


STANDING_S = 10.0  # how often each minter tells every replica and shard its whole live set
FORGET_MINTER_S = 8 * 24 * 3600.0  # a minter not heard from this long minted nothing unexpired (7-day lifetimes)


@dataclass(frozen=True)
class Revocation:
    """What one minter (a trusted process that mints capabilities: ``hosts/revocations.py``) tells every replica and
    bus shard: which of its instances ended (``ended``: instance -> (its capability's expiry, its seq)), and with a
    ``floor``, its standing: every capability it minted below ``floor`` but those in ``live`` has ended."""

    minter: str
    ended: dict[str, tuple[float, int]] = field(default_factory=dict)
    floor: int | None = None
    live: frozenset[int] = frozenset()


@dataclass(frozen=True)
class _Standing:
    floor: int
    live: frozenset[int]
    heard: float  # ``time.time()`` it arrived


class Revocations:
    """Which capabilities belong to instances that ended. Per minter, its latest standing (everything below its
    floor but its live set has ended) and the endings it reported since, each until a standing covers it or its
    capability expires: bounded by the instances running and a few seconds of endings, however many ever ended.
    A replica or shard that (re)starts knows nothing of what ended before; each minter's next standing (within
    ``STANDING_S``) tells it."""

    def __init__(self) -> None:
        self._ended: dict[str, tuple[float, str | None, int | None]] = {}  # instance -> (expiry, minter, seq)
        self._standing: dict[str, _Standing] = {}
        self._next_prune = 0.0

    def apply(self, revocation: Revocation) -> set[str]:
        """Record what ``revocation`` says; returns the instances it newly reports ended."""
        now = time.time()
        if now >= self._next_prune:  # amortised: a sweep at most once a minute
            self._ended = {i: ended for i, ended in self._ended.items() if ended[0] > now}
            self._standing = {m: s for m, s in self._standing.items() if now - s.heard < FORGET_MINTER_S}
            self._next_prune = now + 60.0
        minter = revocation.minter
        fresh = {i for i in revocation.ended if i not in self._ended}
        for instance, (expires, seq) in revocation.ended.items():
            if expires > now and not self._covered(minter, seq):
                self._ended[instance] = (float(expires), minter, seq)
        if revocation.floor is not None:
            self._standing[minter] = _Standing(revocation.floor, frozenset(revocation.live), now)
            self._ended = {i: e for i, e in self._ended.items() if not (e[1] == minter and self._covered(minter, e[2]))}
        return fresh

    def _covered(self, minter: str | None, seq: int | None) -> bool:
        """Whether the minter's standing says its capability ``seq`` has ended."""
        standing = self._standing.get(minter) if minter is not None else None
        return standing is not None and seq < standing.floor and seq not in standing.live

    def refuses(self, capability: Capability) -> bool:
        return capability.instance in self._ended or self._covered(capability.minter, capability.seq)

    def __len__(self) -> int:
        """Entries held: endings not yet covered by a standing, and the live instances of each minter."""
        return len(self._ended) + sum(len(s.live) + 1 for s in self._standing.values())

    def check(self, capability: Capability) -> None:
        if self.refuses(capability):
            raise RevokedError(f"revoked capability: instance {capability.instance!r} has ended")


class Verifier:
    """Capabilities verified once per token (one HMAC), their expiry and their instance's end checked on every use:
    what a replica and a bus shard each believe of who is calling."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._verified: dict[str, Capability] = {}  # token -> what it proved (a cache, emptied past VERIFIED_CACHE)
        self.revoked = Revocations()

    def verify(self, token: str, check: Callable[[Capability], None] | None = None) -> Capability:
        """What ``token`` proves: a ``CapabilityError`` for a forged, malformed or expired one (or one ``check``,
        run when it is first verified, refuses), a ``RevokedError`` for one whose instance ended."""
        capability = self._verified.get(token) if isinstance(token, str) else None
        if capability is None:
            capability = verify(self._secret, token)
            if check is not None:
                check(capability)
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()
            self._verified[token] = capability
        elif time.time() >= capability.expires:
            raise CapabilityError(f"expired capability: instance {capability.instance!r} is past its lifetime")
        self.revoked.check(capability)
        return capability

    def revoke(self, revocation: Revocation) -> set[str]:
        """Apply ``revocation``; returns the instances it newly refuses, those whose capabilities were verified here
        and its standing now covers included."""
        fresh = self.revoked.apply(revocation)
        if revocation.floor is not None:
            fresh |= {c.instance for c in self._verified.values() if self.revoked.refuses(c)}
        return fresh


class Holders:
    """The live authenticated connections (any hashable: a socket's protocol, a ZeroMQ routing id), by the
    instances and users they carry, bounded by ``ConnectionLimits``."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._carried: dict[Hashable, dict[str, str]] = {}  # connection -> instance -> user
        self._by_instance: dict[str, set[Hashable]] = {}
        self._by_user: dict[str, set[Hashable]] = {}

    def join(self, conn: Hashable, capability: Capability) -> None:
        """``conn`` carries ``capability``'s instance from now on; ``ConnectionLimitError`` naming the limit when
        that would take the instance or its user past it."""
        carried = self._carried.setdefault(conn, {})
        instance, user = capability.instance, capability.user
        if instance in carried:
            return
        if len(self._by_instance.get(instance, ())) >= self.limits.per_instance:
            raise ConnectionLimitError(
                f"instance {instance!r} already holds {self.limits.per_instance} connections here "
                f"([limits] connections_per_instance = {self.limits.per_instance})"
            )
        users = self._by_user.get(user, set())
        if conn not in users and len(users) >= self.limits.per_user:
            raise ConnectionLimitError(
                f"user {user!r} already holds {self.limits.per_user} connections here "
                f"([limits] connections_per_user = {self.limits.per_user})"
            )
        carried[instance] = user
        self._by_instance.setdefault(instance, set()).add(conn)
        self._by_user.setdefault(user, set()).add(conn)

    def carries(self, conn: Hashable) -> bool:
        return bool(self._carried.get(conn))

    def of_instance(self, instance: str) -> set[Hashable]:
        return set(self._by_instance.get(instance, ()))

    def drop(self, conn: Hashable, instance: str) -> None:
        """``conn`` no longer carries ``instance`` (it ended)."""
        carried = self._carried.get(conn, {})
        user = carried.pop(instance, None)
        if user is None:
            return
        self._discard(self._by_instance, instance, conn)
        if user not in carried.values():
            self._discard(self._by_user, user, conn)

    def leave(self, conn: Hashable) -> None:
        """``conn`` closed: it counts against nobody."""
        for instance in list(self._carried.get(conn, ())):
            self.drop(conn, instance)
        self._carried.pop(conn, None)

    @staticmethod
    def _discard(index: dict[str, set[Hashable]], key: str, conn: Hashable) -> None:
        holders = index.get(key)
        if holders is not None:
            holders.discard(conn)
            if not holders:
                del index[key]


class RefusalLog:
    """One warning line per ``every_s`` at most, counting the refusals it did not show."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self._log, self._every_s = log, every_s
        self._next = 0.0
        self._suppressed = 0

    def refused(self, what: str, why: object, exc_info: BaseException | None = None) -> None:
        """``exc_info``: a failure of ours, whose traceback is worth the line (the client's input never is)."""
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more in the last {self._every_s:g} s)" if self._suppressed else ""
        self._log.warning("refused %s: %s%s", what, why, more, exc_info=exc_info)
        self._next, self._suppressed = now + self._every_s, 0
