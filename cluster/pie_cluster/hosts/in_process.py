"""The trusted side for inferlets that a process runs itself (``pie run``, benchmarks, tests), as a node's host is
for a cluster's: the secret its replicas and bus shards verify capabilities with, and a capability per instance."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

from pie_workers.wire.capability import mint

LOCAL_TTL_S = 24 * 3600.0  # a local run is one process's lifetime: a day is plenty


@dataclass(frozen=True)
class LocalTrust:
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def instance(self, user: str, instance_id: str | None = None) -> dict[str, str]:
        """``run_inferlet``'s ``instance_id`` (a new one unless given) and its ``capability``, for ``user``."""
        instance_id = instance_id or uuid.uuid4().hex
        return {"instance_id": instance_id, "capability": mint(self.secret, user, instance_id, LOCAL_TTL_S)}
