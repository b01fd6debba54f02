"""What a replica and a bus shard check of a connection before they serve it, shared by both.

A connection proves who it is before anything it sends is parsed (``engine/channel.py``: a capability handshake;
the bus: a capability on every message, checked before its frame is read). Past that, what one instance or user may
hold open is bounded (``ConnectionLimits``, set by ``[limits]``), so that no tenant can crowd the socket every
tenant's calls go through; an instance that ended is refused from then on (``Revocations``: the trusted side that
ended it says so); and what is refused is logged at a bounded rate (``RefusalLog``), since a hostile client could
otherwise fill the log as fast as it can connect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

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


class Revocations:
    """Instances that ended, each until its capability would have expired anyway (then the expiry refuses it)."""

    def __init__(self) -> None:
        self._ended: dict[str, float] = {}  # instance -> its capability's expiry
        self._next_prune = 0.0

    def add(self, ended: dict[str, float]) -> set[str]:
        """Record ``ended`` (instance -> capability expiry); returns the instances not known to have ended before."""
        now = time.time()
        if now >= self._next_prune:  # amortised: a sweep at most once a minute
            self._ended = {i: expires for i, expires in self._ended.items() if expires > now}
            self._next_prune = now + 60.0
        fresh = {i for i in ended if i not in self._ended}
        self._ended.update({i: float(expires) for i, expires in ended.items() if expires > now})
        return fresh

    def __contains__(self, instance: str) -> bool:
        return instance in self._ended

    def __len__(self) -> int:
        return len(self._ended)

    def check(self, capability: Capability) -> None:
        if capability.instance in self._ended:
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
