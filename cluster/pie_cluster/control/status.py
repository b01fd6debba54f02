"""What ``pie status`` shows: every replica with its page use and queue, each node's host, the launcher, bus and
market. A part that is dead or does not answer within the probe deadline is reported as such, never raised."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import ray
import ray.exceptions

from pie_cluster.control.status_records import ClusterStatus, DrainedNode, NodeStatus, ReplicaStatus, Unanswered
from pie_cluster.control.supervisor import probe_ranks

if TYPE_CHECKING:
    from pie_cluster.control.controller import Controller


def cluster_status(controller: Controller) -> ClusterStatus:
    deadline = controller.config.supervision.probe_deadline_s
    replicas = [
        _replica_status(controller, name, i, replica, deadline)
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
        bus = Unanswered("unresponsive")
    except ray.exceptions.RayError:
        bus = Unanswered("dead")
    return ClusterStatus(
        replicas=replicas,
        replica_restarts=controller.supervisor.restarts,
        controller_restarts=controller.restarts,
        nodes=[_node_status(node, alive.get(node, False), got) for node, got in hosts.items()],
        drained=[DrainedNode(node, alive.get(node, False)) for node in sorted(controller.drained)],
        launcher=launcher,
        bus=bus,
        bus_shards=[info.node_id for info in controller.bus.infos],
        market=market,
        scaling=list(controller.scaler.scales().values()),
        released=sorted(controller.release.released & {n for n, up in alive.items() if up}),
    )


def _replica_status(controller: Controller, name: str, index: int, replica, deadline: float) -> ReplicaStatus:
    info = replica.info
    status = functools.partial(
        ReplicaStatus,
        model=name,
        replica=index,
        node=info.node_id,
        model_dir=info.model_dir,
        tensor_parallel=info.tensor_parallel_size,
        cpus_per_rank=controller.cpus_per_rank(name),
        threads=info.threads,
        device=info.device,
        backend=info.backend,
        decode_graphs=info.decode_graphs,
    )
    if (name, index) in controller.supervisor.restarting:
        return status(state="restarting")
    probe = probe_ranks(replica.ranks, deadline)
    pids = list(probe.pids)
    if probe.state != "serving":
        return status(state=probe.state, pids=pids)
    stats = _probe(replica.leader.engine_stats.remote(), deadline)
    if isinstance(stats, Unanswered):
        return status(state=stats.state, pids=pids)
    return status(
        state="serving",
        pids=pids,
        pages_used=stats.total - stats.free - stats.cached,
        pages_cached=stats.cached,
        pages_total=stats.total,
        queued=stats.queued,
        batches=stats.batches,
        requests=stats.requests,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        contexts=stats.contexts,
        suspended=stats.suspended,
        price=stats.price,
    )


def _probe(ref, deadline: float) -> object:
    """The reply to a status call, or ``Unanswered`` in its place."""
    try:
        return ray.get(ref, timeout=deadline)
    except ray.exceptions.GetTimeoutError:
        return Unanswered("unresponsive")
    except ray.exceptions.RayError:
        return Unanswered("dead")


def _node_status(node: str, alive: bool, described: object) -> NodeStatus:
    if isinstance(described, Unanswered):
        return NodeStatus(node, alive, described.state)
    return NodeStatus(node, alive, "serving", described)
