"""What a node's inferlet host says of itself (``InferletHost.describe``), as ``pie status`` shows it per node."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolStats:
    """A node's sandboxed workers (``WorkerPool.stats``)."""

    workers: int
    users: int  # with at least one worker
    instances: int
    spare: bool  # a spare worker is started, for the next user's first launch
    limits: str  # "cgroup": the kernel bounds each worker as a whole; "rlimit": see ``sandbox/limits.py``


@dataclass(frozen=True)
class HostDescription:
    """How the host runs uploaded programs: ``sandbox`` "bubblewrap" with its worker pool, or "off" (trusted users
    only: their code runs in the host and can reach Ray), without one."""

    sandbox: str
    pool: PoolStats | None = None
