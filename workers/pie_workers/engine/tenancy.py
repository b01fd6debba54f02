"""What a replica enforces per verified user: the bounds on what tenants share, set by the operator (``[limits]``
and ``[cache]`` in the cluster's config) and applied where the state lives, never in the untrusted SDK.

One frozen record travels from the controller to the replica's engine; each part of the engine reads the fields it
enforces. Defaults are what an unconfigured cluster runs with, so a replica made without one is bounded too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pie_workers.wire.admission import ConnectionLimits


@dataclass(frozen=True)
class TenantLimits:
    """Per-user bounds a replica enforces, and whether its prefix cache is shared across users."""

    shared_prefixes: bool = False  # True: a page is found by any user's lookup (``[cache] share = "cluster"``)
    snapshots_per_user: int = 1024  # snapshots one user holds on this replica
    snapshot_pages_per_user: int | None = None  # pages of those the directory cannot recompute; None: half the pool
    adapter_max_rank: int = 256  # a LoRA rank (also at most the adapted layers' smaller dimension)
    adapters_per_user: int = 64  # adapters one user holds on this replica
    adapter_bytes_per_user: int = 1 << 30  # bytes of their weights (float32) here
    # connections to its channel: per instance, per user, unverified per peer, and the handshake's deadline
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


class QuotaExceeded(ValueError):
    """A request would take its user past one of the operator's ``[limits]``; the message names the limit. Nothing
    changed (the SDK raises it as ``inferlet.QuotaExceeded``)."""


class TokenBudgetExhausted(RuntimeError):
    """A pass past the token budget its instance's capability grants (the SDK raises it as
    ``inferlet.TokenBudgetExhausted``)."""
