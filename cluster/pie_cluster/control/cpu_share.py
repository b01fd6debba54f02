"""How many CPUs (torch threads) each rank of a model replica gets when ``[[model]] cpus_per_rank`` is left unset.

A rank's CPUs are its Ray bundle's CPUs and its torch threads: one thread decodes a model at a fraction of what the
node's cores can (on a 2-core node, 0.6x vLLM's offline engine with 1 thread, 1.0x with 2). So the default is what
the nodes can spare: the CPUs Ray has free on the nodes (control-plane actors take none), split evenly among the
ranks expected on one node. An explicit ``cpus_per_rank`` is kept as given (and counted when the share is fitted).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pie_cluster.config import ModelConfigEntry


@dataclass(frozen=True)
class NodeRoom:
    """What one alive node can spare now: Ray's available CPUs and its other available (custom) resources."""

    cpus: float
    resources: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelShape:
    """The part of a ``[[model]]`` entry that decides its bundles: ``replicas`` bundles of ``tensor_parallel``
    ranks each; ``cpus_per_rank`` None when automatic."""

    tensor_parallel: int = 1
    replicas: int = 1
    placement: str = "spread"  # "spread", "strict_spread", "pack"
    cpus_per_rank: int | None = None
    resources: Mapping[str, float] = field(default_factory=dict)


def automatic_cpus_per_rank(nodes: Sequence[NodeRoom], models: Sequence[ModelShape]) -> int:
    """The CPUs each rank of an automatic model gets (the same for all of them), at least 1.

    ``floor(node CPUs / ranks per node)``: node CPUs are the smallest free CPU count among the nodes that can take a
    rank at all (so a bundle fits any of them); ranks per node are all models' ranks spread evenly over those nodes,
    and never fewer than the largest tensor-parallel group (its ranks share one node). Several models fragment the
    nodes, so the share is then lowered until the bundles, placed in config order as Ray's strategies do, all fit;
    where none does, 1, the old fixed default."""
    usable = [n for n in nodes if n.cpus >= 1]
    if not usable or not models:
        return 1
    ranks = sum(m.tensor_parallel * m.replicas for m in models)
    per_node = max(max(m.tensor_parallel for m in models), math.ceil(ranks / len(usable)))
    share = max(1, int(min(n.cpus for n in usable) // per_node))
    while share > 1 and not places(usable, models, share):
        share -= 1
    return share


def places(nodes: Sequence[NodeRoom], models: Sequence[ModelShape], share: int) -> bool:
    """Whether every model's bundles fit the nodes with ``share`` CPUs per automatic rank, each model's placement
    group placed in turn: spread onto the unused node with most room, strict_spread never twice on a node, pack onto
    a node already used (the fullest that fits)."""
    free = [n.cpus for n in nodes]
    room = [dict(n.resources) for n in nodes]
    for m in models:
        cpus = (m.cpus_per_rank or share) * m.tensor_parallel
        used: set[int] = set()
        for _ in range(m.replicas):
            fits = [
                i
                for i in range(len(nodes))
                if free[i] >= cpus and all(room[i].get(k, 0) >= v for k, v in m.resources.items())
            ]
            if m.placement == "strict_spread":
                fits = [i for i in fits if i not in used]
            if not fits:
                return False
            if m.placement == "pack":
                i = min(fits, key=lambda i: (i not in used, free[i]))
            else:
                i = max(fits, key=lambda i: (i not in used, free[i]))
            free[i] -= cpus
            for k, v in m.resources.items():
                room[i][k] -= v
            used.add(i)
    return True


def automatic_cpus_for(models: Sequence[ModelConfigEntry]) -> int:
    """The CPUs per rank of the ``[[model]]`` entries that leave ``cpus_per_rank`` unset, from what the connected
    cluster's nodes spare now."""
    if all(e.cpus_per_rank is not None for e in models):
        return 1  # unused
    shapes = [ModelShape(e.tensor_parallel, e.replicas, e.placement, e.cpus_per_rank, e.resources) for e in models]
    return automatic_cpus_per_rank(node_room(), shapes)


def node_room() -> list[NodeRoom]:
    """What each alive node of the connected Ray cluster can spare now (Ray's view; it lags by a moment)."""
    from ray._private.state import available_resources_per_node  # a DeveloperAPI: ray.nodes() has only totals

    return [
        NodeRoom(
            cpus=free.get("CPU", 0.0),
            resources={k: v for k, v in free.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")},
        )
        for free in available_resources_per_node().values()
    ]
