"""``pie drain NODE``: take a node out of the cluster's use without failing the work on it.

The node is closed to launches at once (a launch pinned to it gets an error saying it was drained); its running
instances get up to the timeout to finish, and what is left then ends with an error event naming the drain; then
its inferlet host is stopped and never started there again. Its replicas serve on until the node leaves the cluster
(the operator, the autoscaler or KubeRay removes it): the inferlets using them then move to the model's other
replicas (``inferlet._failover``), and Ray places the replicas again where their bundles fit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from pie_workers.deadlines import LAUNCHER_S, answered

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


def drain_node(controller: Controller, node: str, timeout_s: float) -> DrainReport:
    """Drain ``node`` (the module's docstring says how)."""
    hosts, launcher = controller.hosts, controller.launcher
    if node not in hosts:
        raise ValueError(f"no inferlet host on node {node!r}; nodes: {', '.join(sorted(hosts))}")
    if len(hosts) == 1:
        raise ValueError(f"node {node} is the last with an inferlet host: draining it would stop every launch")
    started = time.monotonic()
    running = answered(launcher.drain.remote(node), "the launcher", LAUNCHER_S)
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
    )
