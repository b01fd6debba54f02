"""What ``pie status`` shows: every replica with its page use and queue, each node's host, the launcher, bus and
market. A part that is dead or does not answer within the probe deadline is reported as such, never raised."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import ray
import ray.exceptions

from pie_cluster.control.supervisor import probe_ranks
from pie_cluster.launcher.records import LauncherStats

if TYPE_CHECKING:
    from pie_cluster.control.controller import Controller

_ENGINE_FIELDS = ("queued", "batches", "requests", "prefix_hit_tokens", "contexts", "suspended", "price")


def cluster_status(controller: Controller) -> dict:
    deadline = controller.config.supervision.probe_deadline_s
    replicas = [
        _replica_row(controller, name, i, replica, deadline)
        for name, group in controller.replicas.items()
        for i, replica in enumerate(group)
    ]
    alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    hosts = {node: _probe(host.describe.remote(), deadline) for node, host in list(controller.hosts.items())}
    launcher = _probe(controller.launcher.stats.remote(), deadline)
    market = _probe(controller.market.summary.remote(), deadline)
    try:
        bus = controller.bus.stats(timeout=deadline)
    except ray.exceptions.GetTimeoutError:
        bus = "unresponsive"
    except ray.exceptions.RayError:
        bus = "dead"
    return {
        "replicas": replicas,
        "replica_restarts": controller.supervisor.restarts,
        "controller_restarts": controller.restarts,
        "nodes": [{"node": node, "alive": alive.get(node, False), **_host_row(got)} for node, got in hosts.items()],
        "drained": [{"node": node, "alive": alive.get(node, False)} for node in sorted(controller.drained)],
        "launcher": dataclasses.asdict(launcher) if isinstance(launcher, LauncherStats) else {"state": launcher},
        "bus": bus if isinstance(bus, dict) else {"state": bus},
        "bus_shards": [info.node_id for info in controller.bus.infos],  # each shard's node, in shard order
        "market": market if isinstance(market, dict) else {"state": market},
    }


def _replica_row(controller: Controller, name: str, index: int, replica, deadline: float) -> dict:
    info = replica.info
    row = {
        "model": name,
        "replica": index,
        "node": info.node_id,
        "model_dir": info.model_dir,
        "tensor_parallel": info.tensor_parallel_size,
        "cpus_per_rank": controller.cpus_per_rank(name),
        "threads": info.threads,
        "device": info.device,
        "backend": info.backend,
    }
    if (name, index) in controller.supervisor.restarting:
        return {**row, "state": "restarting"}
    probe = probe_ranks(replica.ranks, deadline)
    row["pids"] = list(probe.pids)
    stats = _probe(replica.leader.engine_stats.remote(), deadline) if probe.state == "serving" else probe.state
    if isinstance(stats, str):
        return {**row, "state": stats}
    return {
        **row,
        "state": "serving",
        "pages_used": stats["total"] - stats["free"] - stats["cached"],
        "pages_cached": stats["cached"],
        "pages_total": stats["total"],
        **{field: stats[field] for field in _ENGINE_FIELDS},
    }


def _probe(ref, deadline: float) -> object:
    """The reply to a status call, or "dead" / "unresponsive" in its place."""
    try:
        return ray.get(ref, timeout=deadline)
    except ray.exceptions.GetTimeoutError:
        return "unresponsive"
    except ray.exceptions.RayError:
        return "dead"


def _host_row(described: object) -> dict:
    """A node's host as ``pie status`` shows it: serving with its sandbox mode and workers, or dead / no answer."""
    if isinstance(described, dict):
        return {"host": "serving", **described}
    return {"host": described}
