"""The controller: brings up (and tears down) everything a Pie cluster runs on top of Ray.

``pie start`` creates it as a detached named actor, so the services outlive the command: the KV-page market, the
model replicas of every ``[[model]]`` (tensor-parallel groups, one bundle each of the model's placement group, so
replicas spread over nodes; each reports to the market), the message bus shards, one pooled inferlet host per node
(nodes that join later get theirs), and the launcher (named, so the HTTP app and Ray jobs find it). It also
computes, per node, how an inferlet there reaches each model: over ipc to a replica on the same node when there is
one, else over tcp. Models are named to replicas by path or as the embedded model, never by a path from the
controller's node: each replica resolves its model where it runs, and hosts get a model's tokenizer files through
Ray. Replicas that die or hang are replaced by the supervisor (``supervisor.py``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from dataclasses import dataclass

import ray
import ray.exceptions
from inferlet.runtime import ModelEndpoint
from pie_workers.deadlines import LAUNCHER_S, answered
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.model_dir import ModelSource
from pie_workers.replica import Replica, replica_placement
from pie_workers.runner import RunnerSettings
from pie_workers.tiny_model import EmbeddedModel
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.bus import start_bus
from pie_cluster.config import ModelConfigEntry, PieConfig
from pie_cluster.cpu_share import ModelShape, automatic_cpus_per_rank, node_room
from pie_cluster.directory import get_or_create_directory
from pie_cluster.drain import drain_node
from pie_cluster.inferlet_host import InferletHost, NodeServices
from pie_cluster.instance_record import HostPool
from pie_cluster.launcher import Launcher
from pie_cluster.market import get_or_create_market
from pie_cluster.responses_store import get_or_create_store
from pie_cluster.supervisor import Supervisor, probe_ranks

CONTROLLER = "pie-controller"
LAUNCHER = "pie-launcher"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ModelPlacement:
    """How a model's replicas are made: its config entry and the placement group their bundles are in."""

    entry: ModelConfigEntry
    group: PlacementGroup
    use_gpu: bool
    cpus_per_rank: int  # the entry's, or the automatic share (cpu_share.py)


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


def _automatic_cpus(config: PieConfig) -> int:
    """The CPUs per rank of the models that leave ``cpus_per_rank`` unset, from what the nodes spare now."""
    shapes = [
        ModelShape(e.tensor_parallel, e.replicas, e.placement, e.cpus_per_rank, e.resources) for e in config.model
    ]
    if all(e.cpus_per_rank is not None for e in config.model):
        return 1  # unused
    return automatic_cpus_per_rank(node_room(), shapes)


class Controller:
    def __init__(self, config: PieConfig):
        self.config = config
        self.replicas: dict[str, list[Replica]] = {}
        self.placements: list[PlacementGroup] = []
        self._models: dict[str, _ModelPlacement] = {}
        _check_placements(config)
        self._auto_cpus = _automatic_cpus(config)
        self.secret = secrets.token_bytes(32)  # signs instances' capabilities; only trusted actors are given it
        namespace = ray.get_runtime_context().namespace
        # the control plane stays on the controller's node (the head's, for `pie start`): a zero-CPU actor could
        # otherwise land on any worker, and losing that worker would take the launcher or the market with it
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.market = get_or_create_market(namespace, config.market.default_endowment, scheduling_strategy=here)
        self.directory = get_or_create_directory(namespace, scheduling_strategy=here)
        self.responses = get_or_create_store(namespace, config.responses, self.directory, scheduling_strategy=here)
        for entry in config.model:
            self.replicas[entry.name] = self._start_replicas(entry)
        self.bus = start_bus(shards=config.bus.shards, detached=False, secret=self.secret)
        nodes = sorted(_alive_nodes())
        launcher_cls = ray.remote(Launcher).options(
            name=LAUNCHER, num_cpus=0, max_concurrency=100_000, scheduling_strategy=here, max_restarts=-1
        )
        self.launcher = launcher_cls.remote(config.launcher, config.sandbox.enabled, config.supervision)
        services = self._services(nodes)
        self.hosts = {node: self._start_host(node, services[node]) for node in nodes}
        pool = HostPool(
            hosts=self.hosts,
            services=services,
            secret=self.secret,
            model_nodes=tuple(sorted({r.info.node_id for rs in self.replicas.values() for r in rs})),
        )
        answered(self.launcher.attach_pool.remote(pool), "the launcher", LAUNCHER_S)
        self.hosting = threading.Lock()  # hosts added and services published one at a time
        self.drained: set[str] = set()  # nodes `pie drain` released: no host is started there again
        self._stopping = threading.Event()
        self.supervisor = Supervisor(config.supervision, self.replicas, self._new_replica, self._publish)
        threading.Thread(target=self._watch_nodes, name="node-watcher", daemon=True).start()

    def _start_host(self, node: str, services: NodeServices):
        """The pooled inferlet host of ``node``; Ray restarts it if it dies (the launcher fails what it ran)."""
        return (
            ray.remote(InferletHost)
            .options(
                num_cpus=0,
                max_restarts=-1,
                max_concurrency=100_000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(self.launcher, services, self.secret, self.config.sandbox, self.config.launcher.channel_limits())
        )

    def _watch_nodes(self) -> None:
        """A node that joins after the start gets a pooled host, and the launcher places launches there."""
        while not self._stopping.wait(self.config.supervision.probe_every_s):
            for node in sorted(_alive_nodes() - set(self.hosts) - self.drained):
                try:
                    self._add_host(node)
                except Exception:  # e.g. the launcher does not answer: tried again on the next round
                    log.exception("starting an inferlet host on the new node %s failed", node)

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
            log.info("node %s joined: its inferlet host takes launches", node)

    def _services(self, nodes) -> dict[str, NodeServices]:
        """What inferlets on each node reach: the models (through this node's view of the replicas), bus, MCP
        servers, market, and the models' tokenizer files (fetched anew: a dead replica's would be lost)."""
        model_files = {name: replicas[0].leader.model_files.remote() for name, replicas in self.replicas.items()}
        return {
            node: NodeServices(
                endpoints=self.endpoints(node),
                replicas=self.replica_endpoints(node),
                bus=self.bus.addresses(node),
                mcp_servers=self.config.mcp_specs(),
                market=self.market,
                model_files=model_files,
            )
            for node in nodes
        }

    def _publish(self) -> None:
        """A replica was replaced: hosts and the launcher get the new addresses."""
        with self.hosting:
            services = self._services(list(self.hosts))
            for node, host in self.hosts.items():
                host.set_services.remote(services[node])
            answered(self.launcher.set_services.remote(services), "the launcher", LAUNCHER_S)

    @property
    def _deadline(self) -> float:
        return self.config.supervision.probe_deadline_s

    def _start_replicas(self, entry: ModelConfigEntry) -> list[Replica]:
        """The model's replicas, one bundle each of one placement group (spread over nodes as configured)."""
        use_gpu = entry.use_gpu
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        cpus = entry.cpus_per_rank or self._auto_cpus
        log.info("model %r: %d CPU(s) per rank (%s)", entry.name, cpus, "set" if entry.cpus_per_rank else "automatic")
        group = replica_placement(
            entry.replicas,
            entry.tensor_parallel,
            cpus,
            use_gpu,
            entry.placement.upper(),
            entry.resources,
        )
        self.placements.append(group)
        self._models[entry.name] = _ModelPlacement(entry, group, use_gpu, cpus)
        return [self._new_replica(entry.name, i) for i in range(entry.replicas)]

    def _new_replica(self, name: str, index: int) -> Replica:
        """Replica ``index`` of model ``name``, in its bundle of the model's placement group."""
        model = self._models[name]
        entry = model.entry
        return Replica(
            _model_source(entry),
            entry.tensor_parallel,
            RunnerSettings(num_pages=entry.pages, page_size=entry.page_size, backend=entry.backend),
            model.cpus_per_rank,
            model.use_gpu,
            BatchLimits(max_tokens=entry.max_batch_tokens, max_requests=entry.max_batch_requests),
            market=self.market,
            placement=(model.group, index),
            directory=(self.directory, name),
            secret=self.secret,
            start_s=self.config.supervision.start_s,
        )

    def ready(self) -> bool:
        return True

    def endpoints(self, node_id: str) -> dict[str, ModelEndpoint]:
        """How an inferlet on ``node_id`` reaches each model: a same-node replica over ipc, else one over tcp."""
        out = {}
        for name, replicas in self.replicas.items():
            local = [r for r in replicas if r.info.node_id == node_id]
            chosen = local[0] if local else replicas[hash(node_id) % len(replicas)]
            out[name] = _endpoint(name, chosen, node_id)
        return out

    def replica_endpoints(self, node_id: str) -> dict[str, tuple[ModelEndpoint, ...]]:
        """Every replica of each model as reached from ``node_id`` (ipc on that node, tcp elsewhere), in replica
        order: what the ingress there spreads its own requests over (``prefix_routing``)."""
        return {name: tuple(_endpoint(name, r, node_id) for r in replicas) for name, replicas in self.replicas.items()}

    def status(self) -> dict:
        """Replicas with their page use, batches and queue; nodes and their inferlet hosts; the launcher's counts.
        A part that is dead or does not answer within the probe deadline is reported as such, never raised."""
        replicas = []
        for name, group in self.replicas.items():
            for i, replica in enumerate(group):
                info = replica.info
                row = {
                    "model": name,
                    "replica": i,
                    "node": info.node_id,
                    "model_dir": info.model_dir,
                    "tensor_parallel": info.tensor_parallel_size,
                    "cpus_per_rank": self._models[name].cpus_per_rank,
                    "device": info.device,
                    "backend": info.backend,
                }
                if (name, i) in self.supervisor.restarting:
                    replicas.append({**row, "state": "restarting"})
                    continue
                probe = probe_ranks(replica.ranks, self._deadline)
                row["pids"] = list(probe.pids)
                s = self._probe(replica.leader.engine_stats.remote()) if probe.state == "serving" else probe.state
                if isinstance(s, str):
                    replicas.append({**row, "state": s})
                    continue
                replicas.append(
                    {
                        **row,
                        "state": "serving",
                        "pages_used": s["total"] - s["free"] - s["cached"],
                        "pages_cached": s["cached"],
                        "pages_total": s["total"],
                        "queued": s["queued"],
                        "batches": s["batches"],
                        "requests": s["requests"],
                        "prefix_hit_tokens": s["prefix_hit_tokens"],
                        "contexts": s["contexts"],
                        "suspended": s["suspended"],
                        "price": s["price"],
                    }
                )
        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        hosts = {node: self._probe(host.describe.remote()) for node, host in list(self.hosts.items())}
        launcher = self._probe(self.launcher.stats.remote())
        market = self._probe(self.market.summary.remote())
        try:
            bus = self.bus.stats(timeout=self._deadline)
        except ray.exceptions.GetTimeoutError:
            bus = "unresponsive"
        except ray.exceptions.RayError:
            bus = "dead"
        return {
            "replicas": replicas,
            "replica_restarts": self.supervisor.restarts,
            "nodes": [{"node": node, "alive": alive.get(node, False), **_host_row(got)} for node, got in hosts.items()],
            "drained": [{"node": node, "alive": alive.get(node, False)} for node in sorted(self.drained)],
            "launcher": launcher if isinstance(launcher, dict) else {"state": launcher},
            "bus": bus if isinstance(bus, dict) else {"state": bus},
            "market": market if isinstance(market, dict) else {"state": market},
        }

    def _probe(self, ref) -> object:
        """The reply to a status call, or "dead" / "unresponsive" in its place."""
        try:
            return ray.get(ref, timeout=self._deadline)
        except ray.exceptions.GetTimeoutError:
            return "unresponsive"
        except ray.exceptions.RayError:
            return "dead"

    def nodes(self) -> list[str]:
        return list(self.hosts)

    def drain(self, node: str, timeout_s: float) -> dict:
        """``pie drain`` (``pie_cluster.drain``)."""
        return drain_node(self, node, timeout_s)

    def shutdown(self) -> None:
        """Stop everything, whatever has died already (a dead part is simply skipped)."""
        self.supervisor.stop()
        self._stopping.set()
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
        for placement in self.placements:
            remove_placement_group(placement)


def start_controller(config: PieConfig, detached: bool = True):
    """Create the controller in the current namespace (or return the running one) once every service is up, on
    the caller's node (`pie start` runs on the head)."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    options = {"name": CONTROLLER, "num_cpus": 0, "max_concurrency": 16, "get_if_exists": True}
    options["scheduling_strategy"] = here  # beside the caller (the head, for `pie start`): see Controller
    if detached:
        options["lifetime"] = "detached"
    controller = ray.remote(Controller).options(**options).remote(config)
    ray.get(controller.ready.remote())
    return controller


def find_controller():
    """The running controller of this namespace; a clear error when Pie was not started."""
    try:
        return ray.get_actor(CONTROLLER)
    except ValueError:
        raise RuntimeError("no Pie cluster is running in this Ray namespace: start one with `pie start`") from None


def stop_controller() -> bool:
    """Shut every service down and remove the controller; False when none was running. A controller that died or
    hangs is killed outright: the services it started are its own actors and go with it."""
    try:
        controller = ray.get_actor(CONTROLLER)
    except ValueError:
        return False
    with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        ray.get(controller.shutdown.remote(), timeout=120)
    ray.kill(controller)
    return True


def _endpoint(name: str, replica: Replica, node_id: str) -> ModelEndpoint:
    """How an inferlet on ``node_id`` reaches ``replica``: over ipc on its node, else over tcp."""
    info = replica.info
    return ModelEndpoint(
        name=name,
        address=replica.addresses["ipc" if info.node_id == node_id else "tcp"],
        model_dir=info.model_dir,
        page_size=info.page_size,
        vocab_size=info.vocab_size,
        architecture=info.architecture,
    )


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _host_row(described: object) -> dict:
    """A node's host as ``pie status`` shows it: serving with its sandbox mode and workers, or dead / no answer."""
    if isinstance(described, dict):
        return {"host": "serving", **described}
    return {"host": described}
