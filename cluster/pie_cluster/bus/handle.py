"""Starting, finding and inspecting the message bus: its shards are named Ray actors, got-or-created by name."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.bus.shard import BusShard, ShardInfo, secret_id

DEFAULT_NAME = "pie-bus"
DEFAULT_SHARDS = 2

_ShardActor = ray.remote(BusShard)


@dataclass(frozen=True)
class Bus:
    """Handle on a running bus: its shard actors and where each listens. Picklable, so any task can be handed it."""

    shards: tuple  # actor handles, in shard order
    infos: tuple[ShardInfo, ...]

    def addresses(self, node_id: str | None = None) -> tuple[str, ...]:
        """What goes into an inferlet's ``Runtime.bus``: one address per shard, ipc where the shard shares the
        caller's node (or ``node_id``'s), tcp otherwise."""
        node_id = node_id or ray.get_runtime_context().get_node_id()
        return tuple(info.ipc if info.node_id == node_id else info.tcp for info in self.infos)

    def stats(self, user: str | None = None, timeout: float | None = None) -> dict[str, int]:
        """What the bus holds, summed over shards (only ``user``'s topics and sessions, if given); Ray's
        ``GetTimeoutError`` if a shard does not answer within ``timeout`` s."""
        total: dict[str, int] = {}
        for shard in ray.get([s.stats.remote(user) for s in self.shards], timeout=timeout):
            for name, count in shard.items():
                total[name] = total.get(name, 0) + count
        return total

    def shutdown(self) -> None:
        """Stop and kill every shard; whatever was queued is gone."""
        ray.get([s.stop.remote() for s in self.shards])
        for shard in self.shards:
            ray.kill(shard)


def start_bus(
    shards: int = DEFAULT_SHARDS,
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    detached: bool = True,
    *,
    secret: bytes,
) -> Bus:
    """Get or create the bus ``name`` (shard actors ``{name}-0`` … ``{name}-{shards-1}``) in ``namespace`` (default:
    the caller's). Detached by default so the bus outlives the job that started it; a bus that already runs with
    another shard count is an error, since topics are placed by ``hash % shards``, and so is one that runs under
    another cluster ``secret`` (it would refuse every capability the caller's side mints)."""
    if shards < 1:
        raise ValueError(f"a bus needs at least one shard, not {shards}")
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])

    def shard(index: int):
        options = {
            "name": f"{name}-{index}",
            "namespace": namespace,
            "get_if_exists": True,
            "num_cpus": 0,
            "max_restarts": -1,  # restarted at its addresses (see shard.py), so on its node: it must not move
            "scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=False),
        }
        if detached:
            options["lifetime"] = "detached"
        return _ShardActor.options(**options).remote(index, shards, secret)

    first = shard(0)
    info = ray.get(first.start.remote())
    if info.count != shards:
        raise ValueError(f"the bus {name!r} already runs with {info.count} shards, not {shards}")
    if info.secret_id != secret_id(secret):
        raise ValueError(f"the bus {name!r} already runs under another cluster secret")
    rest = [shard(i) for i in range(1, shards)]
    return Bus((first, *rest), (info, *ray.get([s.start.remote() for s in rest])))


def find_bus(name: str = DEFAULT_NAME, namespace: str | None = None) -> Bus:
    """The running bus ``name``, from any job or task in the cluster."""
    try:
        first = ray.get_actor(f"{name}-0", namespace=namespace)
    except ValueError:
        raise LookupError(f"no message bus {name!r} is running: start one with start_bus()") from None
    info = ray.get(first.start.remote())
    rest = [ray.get_actor(f"{name}-{i}", namespace=namespace) for i in range(1, info.count)]
    return Bus((first, *rest), (info, *ray.get([s.start.remote() for s in rest])))
