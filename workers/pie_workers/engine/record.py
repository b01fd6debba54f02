"""One ``EngineContext`` record per live context, in one registry (``EngineContexts``), as nano-vllm keeps one
``Sequence`` per request: what the engine knows of a context is one record's fields, and passes, chained steps,
steps run ahead and residency are code over it.

The record's pages and lineage are its entry in the ``ContextTable`` (``id``), which also holds snapshots, pages
that no record owns. ``EngineContexts.add`` makes a record for an entry; ``destroy`` ends both, giving back the
host memory its suspension held. A pass or operation that waited for the context's gate may still hold the record
after that; the table entry is gone by then, so whatever it tries on the context fails.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pie_workers.engine.contexts import ContextTable
from pie_workers.engine.gate import Gate
from pie_workers.engine.page_store import namespace_key
from pie_workers.wire.admission import Revocation, Verifier
from pie_workers.wire.capability import Capability, CapabilityError
from pie_workers.wire.messages import MAX_CACHE_SALT

if TYPE_CHECKING:
    from pie_workers.engine.ngram import NgramIndex
    from pie_workers.engine.residency import Suspended
    from pie_workers.engine.steps import StepAhead


@dataclass(eq=False)
class Session:
    """One inferlet run's connection: who it is, as its verified capability says. A context belongs to the session
    that made it."""

    name: str  # ``capability/session``, as the channel names a request's sender
    username: str
    instance: str  # the inferlet's process, whose wallet pays the rent of its contexts
    key: str  # the inferlet run; scopes its contexts
    expires: float  # when its capability does (``time.time()``): past it, its requests are refused
    grants: Capability  # what its capability gives it (models it may reach, its token budget)
    closed: bool = False  # its inferlet ended: a context an operation still in flight makes for it is released


class Sessions:
    """The sessions that sent requests, by their session string: who each is comes from its capability alone
    (signed with the cluster's ``secret``), verified once per token; its expiry and whether its instance ended are
    checked on every request. ``model``: this replica's model name, which a capability's ``models`` grant must
    name (None: a replica outside a cluster, reached by any capability)."""

    def __init__(self, secret: bytes, model: str | None = None) -> None:
        self.model = model
        self._known: dict[str, Session] = {}
        self._verifier = Verifier(secret)
        self.revoked = self._verifier.revoked

    def verify(self, token: str) -> Capability:
        """What ``token`` proves here: a ``CapabilityError`` for a forged, malformed or expired one or one not granted
        this replica's model, a ``RevokedError`` for one whose instance ended."""
        return self._verifier.verify(token, self._granted)

    def _granted(self, capability: Capability) -> None:
        if self.model is not None and capability.models is not None and self.model not in capability.models:
            raise CapabilityError(f"capability of instance {capability.instance!r} does not grant model {self.model!r}")

    def admit(self, name: str) -> Session:
        """The session that sent a request as ``name`` (``capability/session``); a ``CapabilityError`` (which closes
        the connection) for a forged, malformed or expired one, a ``RevokedError`` (which fails the request) for one
        whose instance ended."""
        session = self._known.get(name) if isinstance(name, str) else None
        if session is None:
            token, _, key = name.partition("/") if isinstance(name, str) else ("", "", "")
            if not key:
                raise CapabilityError("malformed session: not capability/session")
            capability = self.verify(token)
            session = Session(name, capability.user, capability.instance, key, capability.expires, capability)
            self._known[name] = session
        elif time.time() >= session.expires:
            raise CapabilityError(f"expired capability: instance {session.instance!r} is past its lifetime")
        else:
            self.revoked.check(session.grants)
        return session

    def revoke(self, revocation: Revocation) -> tuple[set[str], list[Session]]:
        """A minter says which of its instances ended: refuse them from now on; returns the instances it newly
        refuses and their sessions still open here (to be closed as if their connections dropped)."""
        fresh = self._verifier.revoke(revocation)
        ended = [
            session for session in self._known.values() if not session.closed and self.revoked.refuses(session.grants)
        ]
        return fresh | {session.instance for session in ended}, ended

    def get(self, name: str) -> Session | None:
        return self._known.get(name)

    def forget(self, name: str) -> None:
        self._known.pop(name, None)


@dataclass(slots=True, eq=False)
class EngineContext:
    id: int  # its entry in the ``ContextTable``: committed chain, working pages, lineage
    session: Session  # the inferlet run that holds it
    gate: Gate = field(default_factory=Gate)  # turn-taking: one pass or operation at a time
    # KV written under a custom attention mask or a zo seed is hashed with this, so the prefix trie never shares it:
    # set by the context's first such pass, inherited by its forks; empty until then
    salt: bytes = b""
    sampled: int | None = None  # the token its latest pass sampled, for a pass chained on it
    ahead: StepAhead | None = None  # the step run ahead on it, if any
    bid: float = 0.0  # credits per page per tick it offers to keep its pages (``Residency``)
    suspended: Suspended | None = None  # its text while it holds no pages
    deferred: bool = False  # busy when asked to suspend: it suspends when its next pass begins
    last_use: int = -1  # the scheduler's batch count at its latest operation
    drafts: NgramIndex | None = None  # its n-gram index, once it asked for drafts (``ngram.py``)

    @property
    def owner(self) -> str:
        """Its process (inferlet instance)."""
        return self.session.instance


class EngineContexts:
    """The live contexts of a replica, by id, and the host memory slots none of them holds."""

    def __init__(self, table: ContextTable, host_pages: int = 0, shared_prefixes: bool = False) -> None:
        """``shared_prefixes``: any user's lookups find any user's cached pages (``[cache] share = "cluster"``);
        else a context finds only pages its own user wrote."""
        self.table = table
        self.shared_prefixes = shared_prefixes
        self._live: dict[int, EngineContext] = {}
        self.free_host = list(range(host_pages - 1, -1, -1))

    def get(self, ctx: int) -> EngineContext | None:
        return self._live.get(ctx)

    def __iter__(self) -> Iterator[EngineContext]:
        return iter(self._live.values())

    def __len__(self) -> int:
        return len(self._live)

    def create(self, session: Session, cache_salt: str = "") -> EngineContext:
        """A new empty context, finding cached pages of its user (of everyone's, if shared) written under the same
        ``cache_salt``."""
        return self.add(self.table.create(session.username, session.key, self.namespace(session, cache_salt)), session)

    def namespace(self, session: Session, cache_salt: str = "") -> bytes:
        """Whose cached pages a context of ``session`` created with ``cache_salt`` may find (a ValueError for a
        salt that is not a string of at most ``MAX_CACHE_SALT`` characters)."""
        if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT:
            shown = f"{len(cache_salt)} characters" if isinstance(cache_salt, str) else type(cache_salt).__name__
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters, got {shown}")
        return namespace_key(None if self.shared_prefixes else session.username, cache_salt)

    def add(self, ctx: int, session: Session) -> EngineContext:
        """The record of table entry ``ctx`` (just created, forked, opened or taken)."""
        record = self._live[ctx] = EngineContext(ctx, session)
        return record

    def destroy(self, record: EngineContext) -> None:
        """End the context: its pages, its host memory, and what a pass still waiting for its gate could follow."""
        self.table.destroy(record.id)
        self._forget(record)

    def keep(self, record: EngineContext, name: str) -> None:
        """End the resident context by making it snapshot ``name`` (``ContextTable.keep``)."""
        self.table.keep(record.id, name)
        self._forget(record)

    def _forget(self, record: EngineContext) -> None:
        del self._live[record.id]
        if record.suspended is not None and record.suspended.host:
            self.free_host.extend(record.suspended.host)
        record.suspended = record.sampled = record.ahead = record.drafts = None
        record.deferred = False
