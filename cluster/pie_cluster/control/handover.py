"""A replica that leaves while it still answers hands its contexts and snapshots to another replica of its model, KV
pages and all (``pie_workers.engine.handover``), so its inferlets go on there without recomputing their prefill:
what ``pie drain`` does for a node's replicas, and the scaler for a replica it removes.

A handover that cannot be made (no other replica of the model, the target refused it or did not answer) changes
nothing: the replica serves on, and its inferlets recompute their contexts from their lineage when it goes, as
after any replica's loss.
"""

from __future__ import annotations

import logging
import time

import ray
import ray.exceptions
from pie_workers.replica import Replica

log = logging.getLogger(__name__)

HANDOVER_S = 180.0  # for the leaving replica's contexts to settle and the target to install them
NOTICE_S = 30.0  # for the inferlets whose contexts moved to hear so, before the replica that left stops
POLL_S = 0.5


def successor(group: list[Replica], leaving: Replica, node: str | None = None) -> Replica | None:
    """The replica of ``group`` to take over from ``leaving``: the first other one (the one its inferlets' failover
    lists name first), off ``node`` when it is given (a node being drained)."""
    return next((r for r in group if r is not leaving and (node is None or r.info.node_id != node)), None)


def hand_over(leaving: Replica, target: Replica) -> str | None:
    """Move ``leaving``'s contexts and snapshots to ``target``; what moved, in words, or None if nothing could."""
    addresses = [target.addresses[kind] for kind in ("ipc", "tcp") if kind in target.addresses]
    try:
        adopted = ray.get(leaving.leader.hand_over.remote(target.leader, addresses), timeout=HANDOVER_S)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
        log.warning("the replica's contexts could not move with their KV (they are recomputed where they go): %s", e)
        return None
    for why in adopted.refused:
        log.warning("not moved with its KV (recomputed where it goes): %s", why)
    return f"{len(adopted.contexts)} contexts and {len(adopted.snapshots)} snapshots moved with their KV"


def wait_for_notices(replica: Replica, timeout_s: float = NOTICE_S) -> bool:
    """Whether every inferlet session whose contexts ``replica`` handed over heard so within ``timeout_s`` (one
    that did not claims them when its next call finds the replica gone, or has them recomputed)."""
    return stats_until(replica, lambda stats: stats.unnotified == 0, timeout_s)


def stats_until(replica: Replica, done, timeout_s: float) -> bool:
    """Whether ``done(its EngineStats)`` came true within ``timeout_s`` (False at once if it is dead or hung)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if done(ray.get(replica.leader.engine_stats.remote(), timeout=10)):
                return True
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False
        time.sleep(POLL_S)
    return False
