"""An instance's events and inbox from a driver, blocking: for scripts, benches and tests that drive a cluster from
a plain process. The cluster's own parts use ``hosts.events.follow``, which never blocks an event loop."""

from __future__ import annotations

import time

import ray
import ray.exceptions
from pie_workers.deadlines import LAUNCHER_S

from pie_cluster.hosts.events import EventBatch


def poll(launcher, user: str, instance: str, since: int = 0, wait: float = 10.0) -> EventBatch:
    """One read of the instance's events from where it runs, as its host answers. If
    its host died or hangs, this waits (up to ``wait`` s beyond a call's deadline) for the launcher to learn how the
    instance ended."""
    deadline = time.monotonic() + wait + LAUNCHER_S
    while True:
        where = ray.get(launcher.locate.remote(user, instance, wait), timeout=wait + LAUNCHER_S)
        if where.host is not None:
            try:
                return ray.get(where.host.events.remote(user, instance, since, wait), timeout=wait + LAUNCHER_S)
            except ray.exceptions.RayError:
                if where.ending is None and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                if where.ending is None:
                    raise
        if where.ending is not None:
            return where.last_batch(since)
        return EventBatch([], since, False)


def deliver(launcher, user: str, instance: str, value: str | bytes) -> None:
    """Send the instance a session message (a ``str``) or file (``bytes``), into its inbox where it runs."""
    where = ray.get(launcher.locate.remote(user, instance, LAUNCHER_S), timeout=2 * LAUNCHER_S)
    if where.host is None:
        raise RuntimeError(f"instance {instance} is not running")
    kind = "file" if isinstance(value, bytes) else "message"
    ray.get(where.host.send.remote(user, instance, kind, value), timeout=LAUNCHER_S)
