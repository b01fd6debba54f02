"""The controller: brings up (and tears down) everything a Pie cluster runs on top of Ray.

``pie start`` creates it as a detached named actor, so the services outlive the command: the KV-page market, the
model replicas of every ``[[model]]`` (tensor-parallel groups, one bundle each of the model's placement group, so
replicas spread over nodes; each reports to the market), the message bus shards, one pooled inferlet host per node
(nodes that join later get theirs), and the launcher (named, so the HTTP app and Ray jobs find it). It also
computes, per node, how an inferlet there reaches each model: over ipc to a replica on the same node when there is
one, else over tcp. Models are named to replicas by path or as the embedded model, never by a path from the
controller's node: each replica resolves its model where it runs, and hosts get a model's tokenizer files through
Ray. Replicas that die or hang are replaced by the supervisor (``supervisor.py``); an autoscaled model's replicas
follow its load (``autoscaler.py``, ``scaling.py``).

Beside it: what each node's inferlets reach (``control/services.py``), its recovery, status and drain
(``control/recovery.py``, ``control/status.py``, ``control/drain.py``), and how a driver starts, finds and stops it
(``control/lifecycle.py``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import ray
import ray.exceptions
from inferlet.runtime import ModelEndpoint
from pie_workers.deadlines import LAUNCHER_S, answered
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.model_dir import ModelSource
from pie_workers.replica import Replica, replica_placement
from pie_workers.runner_settings import RunnerSettings
from pie_workers.tiny_model import EmbeddedModel
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.bus import replace_shards, start_bus
from pie_cluster.config import ModelConfigEntry, PieConfig
from pie_cluster.control.autoscaler import ModelScale
from pie_cluster.control.cpu_share import automatic_cpus_for
from pie_cluster.control.drain import DrainReport, drain_node
from pie_cluster.control.node_release import NodeRelease
from pie_cluster.control.preferred_node import preferring
from pie_cluster.control.recovery import (
    HOST_PREFIX,
    REPLICA_PREFIX,
    ControllerMemory,
    ControllerState,
    ModelPlacement,
    kill_orphans,
    trim_placements,
)
from pie_cluster.control.scaling import ReplicaScaler
from pie_cluster.control.services import model_endpoints, node_services, replica_endpoints
from pie_cluster.control.status import cluster_status
from pie_cluster.control.status_records import ClusterStatus
from pie_cluster.control.supervisor import Supervisor
from pie_cluster.hosts.node_host import InferletHost, NodeServices
from pie_cluster.launcher.actor import Launcher
from pie_cluster.launcher.records import HostPool
from pie_cluster.market import get_or_create_market
from pie_cluster.stores.directory import get_or_create_directory
from pie_cluster.stores.responses import get_or_create_store

LAUNCHER = "pie-launcher"
log = logging.getLogger(__name__)


def _model_source(entry: ModelConfigEntry) -> ModelSource:
    return entry.path if entry.path is not None else EmbeddedModel(entry.arch)


def _check_placements(config: PieConfig) -> None:
    """Refuse, before anything starts, what Ray could never place (it would wait forever)."""
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    for entry in config.model:
        if entry.placement == "strict_spread" and entry.replicas > nodes:
            raise ValueError(
                f"model {entry.name!r}: placement 'strict_spread' needs a node per replica, but {entry.replicas} "
                f"replicas were asked of {nodes} node(s)"
            )


class Controller:
    """Builds the cluster, or, restarted by Ray (``restartable``), adopts the one it had built (control/recovery.py)."""

    def __init__(self, config: PieConfig, restartable: bool = False):
        self.config = config
        self.detached = restartable  # what it starts outlives it, so that its restart finds it all running
        self._namespace = ray.get_runtime_context().namespace
        self._memory = ControllerMemory(self._namespace, _reconstructed()) if restartable else None
        self.secret = self._memory.secret(_new_secret) if restartable else _new_secret()
        saved = self._memory.load() if restartable else None
        self.scaler: ReplicaScaler | None = None  # made once the replicas are (below)
        self._saved_scales = saved.scales if saved is not None else {}
        self.release = NodeRelease(self, *((saved.elastic, saved.released) if saved is not None else (set(), set())))
        self.hosting = threading.Lock()  # hosts added and services published one at a time
        self.stopping = threading.Event()
        if saved is None:
            try:
                self._build()
            except BaseException:
                self._discard()
                raise
        else:
            self._adopt(saved)
        self._bus_published = True  # False: the hosts are yet to be given the bus shards' new addresses
        self.supervisor = Supervisor(config.supervision, self.replicas, self.new_replica, self.publish)
        self.scaler = ReplicaScaler(self, self._saved_scales)
        threading.Thread(target=self._watch_nodes, name="node-watcher", daemon=True).start()

    def _build(self) -> None:
        config = self.config
        self.replicas: dict[str, list[Replica]] = {}
        self.models: dict[str, ModelPlacement] = {}
        self.drained: set[str] = set()  # nodes `pie drain` released: no host is started there again
        self.restarts = 0
        self.launcher = self.market = self.directory = self.responses = self.bus = None  # set as each starts
        self.hosts = {}
        _check_placements(config)
        self._auto_cpus = automatic_cpus_for(config.model)
        # the control plane starts on the controller's node (the head's, for `pie start`) rather than on any worker.
        # The market, the directory, the response store and the launcher keep their state in the GCS, so where
        # their node is lost Ray restarts them on another
        here = preferring(ray.get_runtime_context().get_node_id())
        lifetime = "detached" if self.detached else None
        limits, placed = config.limits, {"lifetime": lifetime, "placement": here}
        endowments = {"default_endowment": config.market.default_endowment, "max_endowment": limits.max_endowment}
        self.market = get_or_create_market(self._namespace, **endowments, **placed)
        stored = {
            "store_bytes_per_user": limits.adapter_store_bytes_per_user,
            "snapshots_per_user": limits.snapshots_per_user,
        }
        self.directory = get_or_create_directory(self._namespace, **placed, **stored)
        self.responses = get_or_create_store(
            self._namespace, config.responses, self.directory, lifetime=lifetime, placement=here
        )
        # the launcher and the bus need nothing of the models: their processes start while the replicas load, and
        # every replica of every model loads at once (each waits mostly on its own processes starting)
        launcher_cls = ray.remote(Launcher).options(
            name=LAUNCHER,
            get_if_exists=True,  # one a previous process of a restarted controller made before it died
            lifetime=lifetime,
            num_cpus=0,
            max_concurrency=100_000,
            max_restarts=-1,
            **here,
        )
        channels = config.launcher.channel_limits(config.limits)
        self.launcher = launcher_cls.remote(config.launcher, config.sandbox.enabled, config.supervision, channels)
        bounds = {"limits": limits.bus_limits(), "connections": limits.connection_limits()}
        with ThreadPoolExecutor(thread_name_prefix="start") as starting:
            bus = starting.submit(start_bus, config.bus.shards, detached=self.detached, secret=self.secret, **bounds)
            models = {entry.name: starting.submit(self._start_replicas, entry) for entry in config.model}
        # every start has ended here; what did start is kept, so that a failed build can take it down (_discard)
        if bus.exception() is None:
            self.bus = bus.result()
        self.replicas = {name: started.result() for name, started in models.items() if started.exception() is None}
        for started in (bus, *models.values()):
            if started.exception() is not None:
                raise started.exception()
        nodes = sorted(_alive_nodes())
        services = self._services(nodes)
        self.hosts = {node: self._start_host(node, services[node]) for node in nodes}
        pool = HostPool(
            hosts=self.hosts,
            services=services,
            secret=self.secret,
            model_nodes=tuple(sorted({r.info.node_id for rs in self.replicas.values() for r in rs})),
        )
        answered(self.launcher.attach_pool.remote(pool), "the launcher", LAUNCHER_S)
        self.save()

    def _discard(self) -> None:
        """A build that failed half-way takes down what it had started: detached parts would outlive it, and the
        next `pie start` would be handed them by name."""
        for actor in [self.launcher, self.market, self.directory, self.responses, *self.hosts.values()]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.bus is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                self.bus.shutdown()
        for group in self.replicas.values():
            for replica in group:
                for rank in replica.ranks:
                    ray.kill(rank, no_restart=True)
        for model in self.models.values():
            for group in (model.group, *model.added):
                remove_placement_group(group)

    def _adopt(self, saved: ControllerState) -> None:
        """Take over what the previous process built; what it left half-made is killed."""
        self.models, self.replicas, self.drained = saved.models, saved.replicas, saved.drained
        self.market, self.directory, self.responses = saved.market, saved.directory, saved.responses
        self.launcher, self.bus, self.hosts = saved.launcher, saved.bus, saved.hosts
        self.restarts = saved.restarts + 1
        trim_placements(self.models, self.replicas)
        killed = kill_orphans(saved)
        log.warning("controller restarted: adopted its cluster (restart %d; killed %s)", self.restarts, killed or "-")
        self.save()

    def save(self) -> None:
        """Write what this controller holds where its restart finds it (nothing, when it is not restartable)."""
        if self._memory is None:
            return
        scales = self.scaler.targets() if self.scaler is not None else self._saved_scales
        state = ControllerState(
            models=self.models, replicas=self.replicas, market=self.market, directory=self.directory,
            responses=self.responses, launcher=self.launcher, bus=self.bus, hosts=self.hosts, drained=self.drained,
            restarts=self.restarts, scales=scales, elastic=self.release.elastic, released=self.release.released,
        )  # fmt: skip
        self._memory.save(state)

    def cpus_per_rank(self, model: str) -> int:
        return self.models[model].cpus_per_rank

    def _start_host(self, node: str, services: NodeServices):
        """The pooled inferlet host of ``node``; Ray restarts it if it dies (the launcher fails what it ran)."""
        channels = self.config.launcher.channel_limits(self.config.limits)
        return (
            ray.remote(InferletHost)
            .options(
                name=f"{HOST_PREFIX}{node}/{secrets.token_hex(4)}",
                lifetime="detached" if self.detached else None,
                num_cpus=0,
                max_restarts=-1,
                max_concurrency=100_000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(self.launcher, services, self.secret, self.config.sandbox, channels)
        )

    def _watch_nodes(self) -> None:
        """A node that joins after the start gets a pooled host, and the launcher places launches there; a bus
        shard whose node is lost is made again on another."""
        while not self.stopping.wait(self.config.supervision.probe_every_s):
            alive = _alive_nodes()
            for node in sorted(alive - set(self.hosts) - self.drained - self.release.released):
                try:
                    self._add_host(node)
                except Exception:  # e.g. the launcher does not answer: tried again on the next round
                    log.exception("starting an inferlet host on the new node %s failed", node)
            try:
                self._follow_bus(alive)
                self.release.follow(alive)
            except Exception:  # e.g. the launcher does not answer: tried again on the next round
                log.exception("following the nodes (bus shards, released nodes) failed")

    def _follow_bus(self, alive: set[str]) -> None:
        """Replace the bus shards whose node is not ``alive`` and hand the hosts their new addresses."""
        lost = [info.index for info in self.bus.infos if info.node_id not in alive]
        if lost:
            lasting = (alive - self.drained - self.release.elastic) or (alive - self.drained)  # not where nodes go
            self.bus = replace_shards(self.bus, lost, sorted(lasting), self.secret, self._deadline)
            log.warning("bus shards %s replaced on other nodes (theirs were lost)", lost)
            self._bus_published = False
        if not self._bus_published:
            self.publish()
            self._bus_published = True

    def _add_host(self, node: str) -> None:
        with self.hosting:
            services = self._services([*self.hosts, node])
            host = self._start_host(node, services[node])
            try:
                answered(self.launcher.add_host.remote(node, host, services), "the launcher", LAUNCHER_S)
            except BaseException:  # the next round makes another
                ray.kill(host)
                raise
            self.hosts[node] = host
            self.save()
            log.info("node %s joined: its inferlet host takes launches", node)

    def _services(self, nodes) -> dict[str, NodeServices]:
        return node_services(self.replicas, self.bus, self.market, self.config.mcp_specs(), nodes)

    def publish(self) -> None:
        """A replica was replaced or a bus shard moved: hosts and the launcher get the new addresses."""
        with self.hosting:
            services = self._services(list(self.hosts))
            for node, host in self.hosts.items():
                host.set_services.remote(services[node])
            answered(self.launcher.set_services.remote(services), "the launcher", LAUNCHER_S)
            self.save()

    @property
    def _deadline(self) -> float:
        return self.config.supervision.probe_deadline_s

    def _start_replicas(self, entry: ModelConfigEntry) -> list[Replica]:
        """The model's replicas, one bundle each of one placement group (spread over nodes as configured); those
        an autoscaled model starts with beyond its ``min_replicas`` in groups of their own (``control.scaling``)."""
        use_gpu = entry.use_gpu
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        cpus = entry.cpus_per_rank or self._auto_cpus
        log.info("model %r: %d CPU(s) per rank (%s)", entry.name, cpus, "set" if entry.cpus_per_rank else "automatic")
        shape = (entry.tensor_parallel, cpus, use_gpu)
        group = replica_placement(
            entry.fewest, *shape, entry.placement.upper(), entry.resources, detached=self.detached
        )
        added = tuple(
            replica_placement(1, *shape, "PACK", entry.resources, detached=self.detached)
            for _ in range(entry.replicas - entry.fewest)
        )
        self.models[entry.name] = ModelPlacement(entry, group, use_gpu, cpus, added)
        with ThreadPoolExecutor(thread_name_prefix=f"start-{entry.name}") as starting:
            return list(starting.map(lambda index: self.new_replica(entry.name, index), range(entry.replicas)))

    def new_replica(self, name: str, index: int) -> Replica:
        """Replica ``index`` of model ``name``, in its bundle of the model's placement group."""
        model = self.models[name]
        entry = model.entry
        return Replica(
            _model_source(entry),
            entry.tensor_parallel,
            RunnerSettings(
                num_pages=entry.pages, page_size=entry.page_size, backend=entry.backend, compile=entry.compile
            ),
            model.cpus_per_rank,
            model.use_gpu,
            BatchLimits(max_tokens=entry.max_batch_tokens, max_requests=entry.max_batch_requests),
            market=self.market,
            placement=model.bundle(index),
            directory=(self.directory, name),
            secret=self.secret,
            start_s=self.config.supervision.start_s,
            name=f"{REPLICA_PREFIX}{name}/{index}/{secrets.token_hex(4)}",
            detached=self.detached,
            fit_threads=entry.cpus_per_rank is None,
            tenants=self.config.limits.tenant_limits(self.config.cache),
        )

    def ready(self) -> bool:
        return True

    def endpoints(self, node_id: str) -> dict[str, ModelEndpoint]:
        """How an inferlet on ``node_id`` reaches each model (``control.services``)."""
        return model_endpoints(self.replicas, node_id)

    def replica_endpoints(self, node_id: str) -> dict[str, tuple[ModelEndpoint, ...]]:
        """Every replica of each model as reached from ``node_id`` (``control.services``)."""
        return replica_endpoints(self.replicas, node_id)

    def scaling(self) -> list[ModelScale]:
        """Each autoscaled model's replicas now, target and why (the ingress's ``/metrics``)."""
        return list(self.scaler.scales().values())

    def status(self) -> ClusterStatus:
        """``pie status`` (``pie_cluster.control.status``)."""
        return cluster_status(self)

    def nodes(self) -> list[str]:
        return list(self.hosts)

    def drain(self, node: str, timeout_s: float) -> DrainReport:
        """``pie drain`` (``pie_cluster.control.drain``)."""
        return drain_node(self, node, timeout_s)

    def shutdown(self) -> None:
        """Stop everything, whatever has died already (a dead part is simply skipped)."""
        self.supervisor.stop()
        self.stopping.set()  # the scaler's thread too
        with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.get(self.launcher.close.remote(), timeout=self._deadline)  # its program store leaves the disk
        for actor in [self.launcher, *self.hosts.values(), self.market, self.directory, self.responses]:
            ray.kill(actor)
        with contextlib.suppress(ray.exceptions.RayError):
            self.bus.shutdown()
        for group in self.replicas.values():
            for replica in group:
                try:
                    replica.shutdown()
                except ray.exceptions.RayError:
                    for rank in replica.ranks:
                        ray.kill(rank)
        for model in self.models.values():
            for group in (model.group, *model.added):
                remove_placement_group(group)
        if self._memory is not None:
            self._memory.clear()


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _reconstructed() -> bool:
    return ray.get_runtime_context().was_current_actor_reconstructed


def _new_secret() -> bytes:
    return secrets.token_bytes(32)  # signs instances' capabilities; only trusted actors are given it
