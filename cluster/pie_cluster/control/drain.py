"""``pie drain NODE``: take a node out of the cluster's use without failing the work on it.

The node is closed to launches at once (a launch pinned to it gets an error saying it was drained); its running
instances get up to the timeout to finish, and what is left then ends with an error event naming the drain; then
its inferlet host is stopped and never started there again. First, each of its replicas whose model has a replica
on another node hands that one its contexts and snapshots, KV pages and all (``control.handover``): the inferlets
using it, wherever they run, go on there without recomputing, and it answers every later call with where they went.
Its replicas stay until the node leaves the cluster (the operator, the autoscaler or KubeRay removes it): an
inferlet whose context did not move then recomputes it on another replica (``inferlet._failover``), and Ray places
the replicas again where their bundles fit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from pie_workers.deadlines import LAUNCHER_S, answered

from pie_cluster.control.handover import hand_over, successor

if TYPE_CHECKING:
    from pie_cluster.control.controller import Controller

log = logging.getLogger(__name__)
POLL_S = 0.2
ABORT_GRACE_S = 10.0  # for aborted instances to report their ending before the host is stopped


@dataclass(frozen=True)
class DrainReport:
    """What a drain did, as ``pie drain`` reports it."""

    node: str
    finished: int  # instances that finished within the timeout
    ended: int  # ... and those still running then, ended with an error naming the drain
    seconds: float
    replicas: list[str]  # "model #index" of those still on the node: they serve until it leaves the cluster
    moved: list[str] = field(default_factory=list)  # "model #index: what moved with its KV, to where"


def drain_node(controller: Controller, node: str, timeout_s: float) -> DrainReport:
    """Drain ``node`` (the module's docstring says how)."""
    hosts, launcher = controller.hosts, controller.launcher
    if node not in hosts:
        raise ValueError(f"no inferlet host on node {node!r}; nodes: {', '.join(sorted(hosts))}")
    if len(hosts) == 1:
        raise ValueError(f"node {node} is the last with an inferlet host: draining it would stop every launch")
    started = time.monotonic()
    running = answered(launcher.drain.remote(node), "the launcher", LAUNCHER_S)
    moved = _move_contexts(controller, node)
    at_start = len(running)
    while running and time.monotonic() - started < timeout_s:
        time.sleep(POLL_S)
        running = answered(launcher.drain.remote(node), "the launcher", LAUNCHER_S)
    reason = f"node {node} was drained: the instance did not finish within {timeout_s:g} s"
    ended = len(running)
    if running:
        running = answered(launcher.drain.remote(node, reason), "the launcher", LAUNCHER_S)
        grace = time.monotonic() + ABORT_GRACE_S
        while running and time.monotonic() < grace:  # their ending events on their way
            time.sleep(POLL_S)
            running = answered(launcher.drain.remote(node), "the launcher", LAUNCHER_S)
    with controller.hosting:
        controller.drained.add(node)
        host = hosts.pop(node)
        answered(launcher.remove_host.remote(node, reason), "the launcher", LAUNCHER_S)  # ends any left
        ray.kill(host, no_restart=True)
        controller.save()
    took = time.monotonic() - started
    log.info("node %s drained in %.1f s", node, took)
    return DrainReport(
        node=node,
        finished=at_start - ended,
        ended=ended,
        seconds=round(took, 1),
        replicas=[
            f"{name} #{i}"
            for name, group in controller.replicas.items()
            for i, replica in enumerate(group)
            if replica.info.node_id == node
        ],
        moved=moved,
    )


def _move_contexts(controller: Controller, node: str) -> list[str]:
    """Hand each replica on ``node`` over to one of its model's on another node, where there is one."""
    moved = []
    for name, group in list(controller.replicas.items()):
        for i, replica in enumerate(list(group)):
            target = successor(group, replica, node) if replica.info.node_id == node else None
            if target is not None and (what := hand_over(replica, target)) is not None:
                moved.append(f"{name} #{i}: {what} to #{group.index(target)}")
    return moved
