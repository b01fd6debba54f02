"""Starting, finding and inspecting the message bus: its shards are named Ray actors, got-or-created by name."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import ray
import ray.exceptions
from pie_workers.deadlines import BUS_S, NoAnswer, answered
from pie_workers.wire.admission import ConnectionLimits
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.bus.shard import BusShard, ShardInfo, secret_id
from pie_cluster.bus.topics import BusStats
from pie_cluster.limits import BusLimits

DEFAULT_NAME = "pie-bus"
DEFAULT_SHARDS = 2
NAME_FREED_S = 10.0  # how long a killed shard's name may take to be free for its replacement

_ShardActor = ray.remote(BusShard)


@dataclass(frozen=True)
class Bus:
    """Handle on a running bus: its shard actors and where each listens. Picklable, so any task can be handed it."""

    shards: tuple  # actor handles, in shard order
    infos: tuple[ShardInfo, ...]
    name: str = DEFAULT_NAME
    namespace: str | None = None
    detached: bool = True
    limits: BusLimits = BusLimits()  # what each shard bounds per user (``quotas.py``), for shards made again too
    connections: ConnectionLimits = ConnectionLimits()  # the peers one instance and user may hold on each shard

    def addresses(self, node_id: str | None = None) -> tuple[str, ...]:
        """What goes into an inferlet's ``Runtime.bus``: one address per shard, ipc where the shard shares the
        caller's node (or ``node_id``'s), tcp otherwise."""
        node_id = node_id or ray.get_runtime_context().get_node_id()
        return tuple(info.ipc if info.node_id == node_id else info.tcp for info in self.infos)

    def stats(self, user: str | None = None, timeout: float | None = None) -> BusStats:
        """What the bus holds, summed over shards (only ``user``'s topics and sessions, if given); Ray's
        ``GetTimeoutError`` if a shard does not answer within ``timeout`` s."""
        return sum(ray.get([s.stats.remote(user) for s in self.shards], timeout=timeout), BusStats())

    def shutdown(self) -> None:
        """Stop and kill every shard; whatever was queued is gone."""
        with contextlib.suppress(ray.exceptions.RayError, NoAnswer):  # one dead or hung is killed as it is
            answered([s.stop.remote() for s in self.shards], "the bus shards", BUS_S)
        for shard in self.shards:
            ray.kill(shard)


def start_bus(
    shards: int = DEFAULT_SHARDS,
    name: str = DEFAULT_NAME,
    namespace: str | None = None,
    detached: bool = True,
    *,
    secret: bytes,
    limits: BusLimits = BusLimits(),
    connections: ConnectionLimits | None = None,
) -> Bus:
    """Get or create the bus ``name`` (shard actors ``{name}-0`` … ``{name}-{shards-1}``) in ``namespace`` (default:
    the caller's). Detached by default so the bus outlives the job that started it; a bus that already runs with
    another shard count is an error, since topics are placed by ``hash % shards``, and so is one that runs under
    another cluster ``secret`` (it would refuse every capability the caller's side mints). ``limits``: what each
    shard bounds per user (``[limits]``; a bus that already runs keeps its own), ``connections`` the peers each
    instance and user may hold on a shard."""
    if shards < 1:
        raise ValueError(f"a bus needs at least one shard, not {shards}")
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    bus = Bus((), (), name, namespace, detached, limits, connections or ConnectionLimits())
    first = _shard_actor(bus, 0, shards, nodes[0], secret)
    info = answered(first.start.remote(), "bus shard 0", BUS_S)
    if info.count != shards:
        raise ValueError(f"the bus {name!r} already runs with {info.count} shards, not {shards}")
    if info.secret_id != secret_id(secret):
        raise ValueError(f"the bus {name!r} already runs under another cluster secret")
    rest = [_shard_actor(bus, i, shards, nodes[i % len(nodes)], secret) for i in range(1, shards)]
    infos = answered([s.start.remote() for s in rest], "the bus shards", BUS_S)
    return replace(bus, shards=(first, *rest), infos=(info, *infos))


def replace_shards(bus: Bus, lost: list[int], nodes: list[str], secret: bytes, timeout: float) -> Bus:
    """``bus`` with shards ``lost`` (their node is lost) made again, each on the one of ``nodes`` with the fewest
    shards. Ray restarts a dead shard on its own node only (it is pinned there, with its addresses and journal), so
    one whose node is lost is killed for good and replaced; the replacement reports what was queued there as lost
    (``queued_topics.py``) and listens at new addresses, which the hosts must be given."""
    shards, infos = list(bus.shards), list(bus.infos)
    for index in lost:
        _kill_for_good(bus, index)
        node = min(nodes, key=lambda n: sum(info.node_id == n for info in infos))
        replaces = bus.shards[index]._actor_id.hex()
        shards[index] = _shard_actor(bus, index, len(infos), node, secret, replaces)
        infos[index] = ray.get(shards[index].start.remote(), timeout=timeout)
    return replace(bus, shards=tuple(shards), infos=tuple(infos))


def _kill_for_good(bus: Bus, index: int) -> None:
    """Kill shard ``index`` and wait until its name is free for its replacement."""
    dead = bus.shards[index]
    ray.kill(dead, no_restart=True)
    deadline = time.monotonic() + NAME_FREED_S
    while time.monotonic() < deadline:
        try:
            if ray.get_actor(f"{bus.name}-{index}", namespace=bus.namespace)._actor_id != dead._actor_id:
                return
        except ValueError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"bus shard {index} was killed, but its name was not free within {NAME_FREED_S:g} s")


def _shard_actor(bus: Bus, index: int, count: int, node: str, secret: bytes, replaces: str | None = None):
    options = {
        "name": f"{bus.name}-{index}",
        "namespace": bus.namespace,
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,  # restarted at its addresses (see shard.py), so on its node: it must not move
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
    }
    if bus.detached:
        options["lifetime"] = "detached"
    return _ShardActor.options(**options).remote(index, count, secret, replaces, bus.limits, bus.connections)


def find_bus(name: str = DEFAULT_NAME, namespace: str | None = None) -> Bus:
    """The running bus ``name``, from any job or task in the cluster."""
    try:
        first = ray.get_actor(f"{name}-0", namespace=namespace)
    except ValueError:
        raise LookupError(f"no message bus {name!r} is running: start one with start_bus()") from None
    info = answered(first.start.remote(), "bus shard 0", BUS_S)
    rest = [ray.get_actor(f"{name}-{i}", namespace=namespace) for i in range(1, info.count)]
    infos = answered([s.start.remote() for s in rest], "the bus shards", BUS_S)
    return Bus((first, *rest), (info, *infos), name, namespace)
