"""What a replica enforces per verified user: the bounds on what tenants share, set by the operator (``[limits]``
and ``[cache]`` in the cluster's config) and applied where the state lives, never in the untrusted SDK.

One frozen record travels from the controller to the replica's engine; each part of the engine reads the fields it
enforces. Defaults are what an unconfigured cluster runs with, so a replica made without one is bounded too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantLimits:
    """Per-user bounds a replica enforces, and whether its prefix cache is shared across users."""

    shared_prefixes: bool = False  # True: a page is found by any user's lookup (``[cache] share = "cluster"``)
