"""What the engine keeps per inferlet run and per context, beside the context's pages (``ContextTable``), its bid and
suspension (``Residency``) and its n-gram index (``NgramDrafter``).

One ``ContextState`` per live context, so that destroying a context removes one record. A pass or operation that
waited for the context's gate may still hold the record after that; the context's table entry is gone by then, so
whatever it tries on the context fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pie_workers.engine.gate import Gate

if TYPE_CHECKING:
    from pie_workers.engine.steps import StepAhead


@dataclass(eq=False)
class Session:
    """One inferlet run's connection: who it is, as its verified capability says. A context belongs to the session
    that made it."""

    name: str  # ``capability/session``, as the channel names a request's sender
    username: str
    instance: str
    key: str  # the inferlet run; scopes its contexts
    expires: float  # when its capability does (``time.time()``): past it, its requests are refused


@dataclass(slots=True, eq=False)
class ContextState:
    session: Session  # the inferlet run that holds the context
    gate: Gate = field(default_factory=Gate)  # the context's turn-taking: one pass or operation at a time
    # KV written under a custom attention mask or a zo seed is hashed with this, so the prefix trie never shares it:
    # set by the context's first such pass, inherited by its forks; empty until then
    salt: bytes = b""
    sampled: int | None = None  # the token the context's latest pass sampled, for a pass chained on it
    ahead: StepAhead | None = None  # the step run ahead on it, if any
