"""What a controller that Ray restarts gets back: the cluster it had built, found again rather than built anew.

``pie start`` makes the controller restartable (``max_restarts``) and everything it starts detached, so that its
death takes nothing with it (a non-detached actor dies with its owner). After every change it saves what it holds
in the GCS key-value store (``GcsStore``): the cluster secret, the models' placement groups and replicas, the
hosts, bus, market, directory, response store and launcher, the drained nodes. A restarted controller adopts them,
kills what an interrupted change left half-made (the named ranks of a replacement, or the host of a joining node,
that were never saved), and supervises again: a replica that died meanwhile is replaced on the first probe, a node
that joined gets its host on the first round.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import ray
import ray.util
from pie_workers.replica import Replica
from ray.util.placement_group import PlacementGroup, remove_placement_group

from pie_cluster.bus import Bus
from pie_cluster.config import ModelConfigEntry
from pie_cluster.control.autoscaler import ModelScale
from pie_cluster.gcs_store import GcsStore

REPLICA_PREFIX = "pie-replica/"  # + model/index/token: a replica's ranks are named "{that}/rank-{i}"
HOST_PREFIX = "pie-host/"  # + node/token


@dataclass(frozen=True)
class ModelPlacement:
    """How a model's replicas are made: its config entry, the placement group of its first ``min_replicas``
    replicas' bundles and the one-bundle groups of those beyond (``control.scaling``), in replica order."""

    entry: ModelConfigEntry
    group: PlacementGroup
    use_gpu: bool
    cpus_per_rank: int  # the entry's, or the automatic share (cpu_share.py)
    added: tuple[PlacementGroup, ...] = ()

    def bundle(self, index: int) -> tuple[PlacementGroup, int]:
        """Where replica ``index`` runs: a bundle of the model's group, or its own group's one."""
        base = self.entry.fewest
        return (self.group, index) if index < base else (self.added[index - base], 0)


@dataclass
class ControllerState:
    """Everything a controller holds that a new process of it could not make again without disturbing anyone."""

    models: dict[str, ModelPlacement]
    replicas: dict[str, list[Replica]]
    market: Any
    directory: Any
    responses: Any
    launcher: Any
    bus: Bus
    hosts: dict[str, Any]
    drained: set[str] = field(default_factory=set)
    restarts: int = 0  # how often the controller was restarted and adopted this state
    scales: dict[str, ModelScale] = field(default_factory=dict)  # autoscaled models' targets (control.autoscaler)
    elastic: set[str] = field(default_factory=set)  # nodes autoscaled replicas came for (control.node_release)
    released: set[str] = field(default_factory=set)  # ... that gave their inferlet host back


class ControllerMemory:
    """The controller's saved state and secret, per Ray namespace (one Pie cluster per namespace)."""

    def __init__(self, namespace: str, restarted: bool):
        self._store = GcsStore("pie-controller", namespace)
        self.restarted = restarted

    def secret(self, make) -> bytes:
        """The cluster secret: the saved one after a restart, else ``make()``'s, saved at once (before any part
        that checks capabilities with it is started)."""
        saved = self._store.get(("secret",)) if self.restarted else None
        if saved is None:
            saved = make()
            self._store.put(("secret",), saved)
        return saved

    def load(self) -> ControllerState | None:
        """What the previous process of this controller saved; None on a fresh start (anything older is wiped)."""
        if not self.restarted:
            self._store.delete(("state",))
            return None
        return self._store.get(("state",))

    def save(self, state: ControllerState) -> None:
        self._store.put(("state",), state)

    def clear(self) -> None:
        self._store.clear()


def trim_placements(models: dict[str, ModelPlacement], replicas: dict[str, list[Replica]]) -> None:
    """Remove the one-bundle groups that have no replica: an addition the old process did not finish, or a removal
    it did not (``control.scaling``); the replicas those left half-made are ``kill_orphans``'."""
    for name, model in models.items():
        keep = max(0, len(replicas[name]) - model.entry.fewest)
        for group in model.added[keep:]:
            remove_placement_group(group)
        models[name] = replace(model, added=model.added[:keep])


def kill_orphans(state: ControllerState) -> list[str]:
    """Kill the named ranks and hosts that ``state`` does not hold (made by a change the old process did not live
    to save: they would hold a bundle's resources, or a node's host slot, forever); their names."""
    kept = {_actor_id(rank) for group in state.replicas.values() for replica in group for rank in replica.ranks}
    kept |= {_actor_id(host) for host in state.hosts.values()}
    killed = []
    for name in ray.util.list_named_actors():
        if not name.startswith((REPLICA_PREFIX, HOST_PREFIX)):
            continue
        try:
            actor = ray.get_actor(name)
        except ValueError:  # gone meanwhile
            continue
        if _actor_id(actor) not in kept:
            ray.kill(actor, no_restart=True)
            killed.append(name)
    return killed


def _actor_id(actor) -> str:
    return actor._actor_id.hex()


def kill_saved(namespace: str) -> None:
    """Kill everything a controller of ``namespace`` that can no longer stop it had saved, and forget it."""
    memory = ControllerMemory(namespace, restarted=True)
    state = memory.load()
    if state is not None:
        ranks = [rank for group in state.replicas.values() for replica in group for rank in replica.ranks]
        parts = [state.launcher, *state.hosts.values(), *state.bus.shards, state.market, state.directory]
        for actor in [*parts, state.responses, *ranks]:
            ray.kill(actor, no_restart=True)
        for model in state.models.values():
            remove_placement_group(model.group)
    memory.clear()
