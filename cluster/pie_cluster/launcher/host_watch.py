"""How the launcher learns that a pooled inferlet host is gone: dead, or hung.

A dead host fails the call the launcher keeps open on it (``lifetime``). A hung one (stopped, deadlocked) fails
nothing, so it is also pinged as the supervisor pings replica ranks (``[supervision]``); one that misses ``misses``
pings in a row is killed, and Ray restarts it like a host that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray
import ray.exceptions
from pie_workers.deadlines import NoAnswer, answer

from pie_cluster.config import SupervisionConfig

log = logging.getLogger(__name__)


async def until_gone(node: str, host, settings: SupervisionConfig) -> None:
    """Returns once ``host`` has died, or has been killed (for Ray to restart) because it hung."""
    lifetime = asyncio.ensure_future(_lifetime(host))
    misses = 0
    while not lifetime.done():
        await asyncio.wait({lifetime}, timeout=settings.probe_every_s)
        if lifetime.done():
            return
        try:
            await answer(host.ready.remote(), f"the inferlet host on node {node}", settings.probe_deadline_s)
            misses = 0
        except NoAnswer:
            misses += 1
        except ray.exceptions.RayError:  # it died: lifetime fails too
            continue
        if misses >= settings.misses:
            log.warning("the inferlet host on node %s missed %d pings: killing it for Ray to restart", node, misses)
            ray.kill(host, no_restart=False)
            await lifetime
            return


async def _lifetime(host) -> None:
    with contextlib.suppress(ray.exceptions.RayError):
        await host.lifetime.remote()
