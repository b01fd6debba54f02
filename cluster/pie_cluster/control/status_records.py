"""What ``pie status`` reports, as the controller answers it over Ray (``control/status.py`` gathers it), and the
JSON that ``pie status --json`` prints of it. Only dataclasses here, so that the CLI imports this without the
cluster's heavier modules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie_cluster.bus.topics import BusStats
    from pie_cluster.control.autoscaler import ModelScale
    from pie_cluster.hosts.description import HostDescription
    from pie_cluster.launcher.records import LauncherStats
    from pie_cluster.market.actor import MarketSummary


@dataclass(frozen=True)
class Unanswered:
    """A part that gave no status: "dead" (its actor is gone) or "unresponsive" (no answer within the probe
    deadline)."""

    state: str


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica: where and how it runs, its state, and, only while it serves, its pages, queue and work done."""

    model: str
    replica: int  # its index among the model's replicas
    node: str
    model_dir: str
    tensor_parallel: int
    cpus_per_rank: int
    threads: int
    device: str
    backend: str
    decode_graphs: str  # "eager", or the graphs its decode steps run through and their start-up time
    state: str  # "serving", "restarting", "dead" or "unresponsive"
    pids: list[int | None] | None = None  # each rank's (None for one that gave none); not probed while restarting
    pages_used: int | None = None  # held by contexts and snapshots: neither free nor reclaimable cache
    pages_cached: int | None = None
    pages_total: int | None = None
    queued: int | None = None
    batches: int | None = None
    requests: int | None = None
    prefix_hit_tokens: int | None = None
    contexts: int | None = None
    suspended: int | None = None
    price: float | None = None


@dataclass(frozen=True)
class NodeStatus:
    """A node with an inferlet host: whether Ray sees it alive, and its host's state ("serving", "dead" or
    "unresponsive") with, while it serves, how it runs uploaded programs."""

    node: str
    alive: bool
    host: str
    description: HostDescription | None = None


@dataclass(frozen=True)
class DrainedNode:
    """A node ``pie drain`` released: ``alive`` while it is still in the cluster."""

    node: str
    alive: bool


@dataclass(frozen=True)
class ClusterStatus:
    """The whole report; a part that is dead or does not answer is ``Unanswered``, never an error."""

    replicas: list[ReplicaStatus]
    replica_restarts: int  # replicas the supervisor replaced
    controller_restarts: int
    nodes: list[NodeStatus]
    drained: list[DrainedNode]
    launcher: LauncherStats | Unanswered
    bus: BusStats | Unanswered
    bus_shards: list[str]  # each shard's node, in shard order
    market: MarketSummary | Unanswered
    scaling: list[ModelScale] = dataclasses.field(default_factory=list)  # autoscaled models: target, count, why
    released: list[str] = dataclasses.field(default_factory=list)  # nodes that gave their host back to the autoscaler


def status_json(status: ClusterStatus) -> dict:
    """What ``pie status --json`` prints: the records as dicts, with a replica's numbers that its state does not
    have (None) left out and a node's host description inline, as ``pie status`` has always printed them."""
    report = dataclasses.asdict(status)
    report["replicas"] = [{key: value for key, value in row.items() if value is not None} for row in report["replicas"]]
    report["nodes"] = [_node_json(node) for node in status.nodes]
    return report


def _node_json(node: NodeStatus) -> dict:
    row = {"node": node.node, "alive": node.alive, "host": node.host}
    if node.description is not None:
        row["sandbox"] = node.description.sandbox
        if node.description.pool is not None:
            row.update(dataclasses.asdict(node.description.pool))
    return row
