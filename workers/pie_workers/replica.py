"""One model replica on Ray: a tensor-parallel group of rank actors sharing one placement-group bundle.

Each rank actor owns one ``ModelRunner`` (its weight shards and its share of the KV pool). Rank 0 receives batches
and broadcasts them to the other ranks over torch.distributed (NCCL on GPU, gloo on CPU); followers sit in
``follow`` running whatever the leader sends. Data-parallel replicas are simply more ``Replica`` objects; one
bundle per replica keeps a group on one node, and bundles of one placement group (see ``replica_placement``) put
a model's replicas on different nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import ray.exceptions
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pie_workers.config import ModelConfig
from pie_workers.engine.engine_stats import EngineStats
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.engine.tenancy import TenantLimits
from pie_workers.model_dir import ModelSource, description_files, local_model_dir
from pie_workers.rank_threads import rank_threads, usable_cores
from pie_workers.runner_settings import RunnerSettings
from pie_workers.wire.admission import Revocation
from pie_workers.wire.batch import ForwardBatch, RequestOutput

if TYPE_CHECKING:
    from pie_workers.runner import ModelRunner

STOP_S = 30.0  # a rank's stop: one that does not answer in time is killed as it is


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica tells the engine above it about itself."""

    model_dir: str
    architecture: str
    vocab_size: int
    num_pages: int
    page_size: int
    tensor_parallel_size: int
    device: str
    dtype: str
    node_id: str
    backend: str  # the kernels it runs ("auto" resolved on its device)
    threads: int  # the leader's torch threads
    decode_graphs: str  # how its decode steps run: "eager", or the graphs made at start and how long that took


class RankWorker:
    """One tensor-parallel rank. Runs as an async Ray actor (see ``Replica``); threads = the CPUs of its bundle (never
    more than its cores; with ``fit_threads``, on a CPU, one for a small model: ``rank_threads``).

    Rank 0 may also host the replica engine (contexts, scheduler, inferlet channel) on the actor's event loop.
    """

    def __init__(self, rank: int, world_size: int, threads: int, fit_threads: bool = False):
        import torch

        self.threads, self.fit_threads = max(1, min(threads, usable_cores())), fit_threads
        torch.set_num_threads(self.threads)
        self.rank, self.world_size = rank, world_size
        self.runner: ModelRunner | None = None
        self.engine = None

    async def rendezvous_address(self) -> tuple[str, int]:
        """An address and a free port on this node for the group's torch.distributed store."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    async def start(self, model: ModelSource, settings: RunnerSettings, addr: str, port: int) -> ReplicaInfo:
        import torch

        from pie_workers.parallel import init_group
        from pie_workers.runner import ModelRunner, resolve_device  # torch: the rank's process only, not its driver

        model_dir = local_model_dir(model, f"node {ray.util.get_node_ip_address()}")
        backend = "nccl" if torch.cuda.is_available() and settings.device != "cpu" else "gloo"
        tp = init_group(self.rank, self.world_size, addr, port, backend)
        if self.fit_threads and resolve_device(settings).type == "cpu":
            # before the runner packs and first runs its matmuls: oneDNN keeps the thread count they first ran with
            self.threads = rank_threads(self.threads, ModelConfig.from_dir(model_dir), self.world_size)
            torch.set_num_threads(self.threads)
        self.runner = ModelRunner(model_dir, settings, tp, show_progress=True)
        # Everything alive now (torch, transformers, Ray, the model) lives as long as the rank does: freezing it
        # keeps the garbage collector's full passes from scanning it. Unfrozen, such a pass held the event loop
        # for 75-100 ms every few hundred batches, a stall every inferlet on the replica felt.
        gc.freeze()
        r = self.runner
        return ReplicaInfo(
            model_dir=str(model_dir),
            architecture=r.cfg.architecture,
            vocab_size=r.cfg.vocab_size,
            num_pages=r.num_pages,
            page_size=r.page_size,
            tensor_parallel_size=self.world_size,
            device=str(r.device),
            dtype=str(r.dtype).removeprefix("torch."),
            node_id=ray.get_runtime_context().get_node_id(),
            backend=r.settings.backend,
            threads=self.threads,
            decode_graphs=r.decode_graphs,
        )

    async def start_engine(
        self, limits: BatchLimits, secret: bytes, market=None, directory=None, tenants: TenantLimits = TenantLimits()
    ) -> dict[str, str]:
        """Rank 0: start the engine and its channel, which takes who each inferlet is from capabilities signed with
        ``secret`` (reporting to ``market``, the market actor, when given; with ``directory``, a (user directory
        actor, model name) pair, its snapshots and adapters are named cluster-wide; ``tenants``: what it bounds per
        user); returns the addresses inferlets connect to."""
        from pie_workers.engine.directory_link import DirectoryLink
        from pie_workers.engine.service import ReplicaEngine

        device = f"{Path(self.runner.model_dir).name}/{ray.get_runtime_context().get_actor_id()[:12]}"
        link = None
        if directory is not None:
            actor, model = directory
            link = DirectoryLink(actor, model, ray.get_runtime_context().current_actor)
        self.engine = ReplicaEngine(self.runner, limits, market, device, link, secret=secret, tenants=tenants)
        return self.engine.start(ray.util.get_node_ip_address())

    async def execute(self, batch: ForwardBatch) -> list[RequestOutput]:
        """A batch straight to the runner, for replicas without an engine (whose page tables the caller keeps)."""
        if self.engine is not None:
            raise RuntimeError("this replica's engine owns its KV pool: reach it through the inferlet channel")
        return await asyncio.to_thread(self.runner.execute, batch)

    async def model_files(self) -> dict[str, bytes]:
        """The model's config, tokenizer and template files, for inferlet hosts on nodes without the model."""
        return description_files(self.runner.model_dir)

    async def hand_over(self, target, addresses: list[str]):
        """Rank 0, leaving: hand every context and snapshot, KV pages and all, to ``target`` (another replica's
        rank 0, reached by inferlets at ``addresses``); returns what it adopted (``engine/handover.py``)."""
        return await self.engine.handovers.leave(target, addresses)

    async def adopt(self, handover):
        """Rank 0: install what a leaving replica hands over (``hand_over``'s other end)."""
        return await self.engine.handovers.adopt(handover)

    async def drop_snapshot(self, user: str, name: str) -> None:
        """The snapshot was deleted or taken on another replica: free its pages here (if it is still here)."""
        with contextlib.suppress(LookupError, ValueError):
            self.engine.contexts.delete(user, name)

    async def drop_adapter(self, user: str, name: str) -> None:
        """The adapter was destroyed on another replica: drop the copy here."""
        self.engine.adapters.drop_named(user, name)

    async def refresh_adapter(self, user: str, name: str, adapter) -> None:
        """New weights were loaded into the adapter on another replica: the copy here takes them."""
        self.engine.adapters.refresh_named(user, name, adapter)

    async def revoke(self, revocation: Revocation) -> None:
        """A minter says which of its instances ended (``wire/admission.py``): refuse them from now on."""
        if self.engine is not None:
            self.engine.revoke(revocation)

    async def ping(self) -> int:
        """The supervisor's probe of every rank: answering at all shows the actor's event loop is alive (a follower
        runs its passes in a thread); the pid says which process to look at."""
        return os.getpid()

    async def engine_stats(self) -> EngineStats:
        return await self.engine.stats()

    async def follow(self) -> None:
        await asyncio.to_thread(self.runner.follow)

    async def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.runner is not None and self.world_size > 1 and self.rank == 0:
            await asyncio.to_thread(self.runner.stop_followers)


class Replica:
    """Driver-side handle of one replica: its placement group, rank actors, and the leader to send batches to."""

    def __init__(
        self,
        model: ModelSource,
        tensor_parallel_size: int = 1,
        settings: RunnerSettings = RunnerSettings(),
        cpus_per_rank: int = 1,
        use_gpu: bool | None = None,
        engine: BatchLimits | None = None,
        market=None,
        placement: tuple[PlacementGroup, int] | None = None,
        directory: tuple | None = None,
        secret: bytes | None = None,
        start_s: float | None = None,
        name: str | None = None,
        detached: bool = False,
        fit_threads: bool = False,
        tenants: TenantLimits = TenantLimits(),
    ):
        """``model``: a model directory (resolved on the replica's node) or the embedded model; ``engine``: also
        start the replica engine with these batch limits (what inferlets talk to); ``market``: the market actor its
        engine reports to (None: no market, bids only rank contexts locally); ``placement``: the bundle of a shared
        placement group to run in (see ``replica_placement``; None: a placement group of its own); ``directory``: the
        cluster's user directory actor and this model's name in it (None: snapshots and adapters stay here);
        ``secret``: the cluster's, which its engine verifies inferlets' capabilities with (required with ``engine``:
        a replica never serves unauthenticated inferlets); ``start_s``: how long its ranks may take to be placed and
        load the model (None: no limit) before they are killed and ``TimeoutError`` is raised; ``name``: its ranks are
        named ``{name}/rank-{i}`` (found again by a controller that restarts); ``detached``: its ranks (and its own
        placement group) outlive whoever made it, which must then shut it down; ``fit_threads``: ``cpus_per_rank``
        is automatic, so a CPU rank of a small model runs one thread (``rank_threads``); ``tenants``: what its engine
        bounds per user (``[limits]``, ``[cache]``)."""
        if engine is not None and not secret:
            raise ValueError("a replica that serves inferlets needs the cluster's secret (secret=...)")
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0 and settings.device != "cpu"
        n = tensor_parallel_size
        self._own_placement = placement is None
        if placement is None:
            placement = replica_placement(1, n, cpus_per_rank, use_gpu, detached=detached), 0
        self.placement_group, bundle = placement
        self.name = name
        actor = ray.remote(RankWorker)
        lifetime = {"lifetime": "detached"} if detached else {}
        self.ranks = [
            actor.options(
                **({"name": f"{name}/rank-{i}"} if name else {}),
                **lifetime,
                num_cpus=cpus_per_rank,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=bundle
                ),
            ).remote(i, n, cpus_per_rank, fit_threads)
            for i in range(n)
        ]
        try:
            self._start(model, settings, engine, market, directory, secret, start_s, tenants)
        except BaseException:  # ranks left waiting for a bundle or half-loaded would hold its resources
            for r in self.ranks:
                ray.kill(r)
            raise

    def _start(self, model, settings, engine, market, directory, secret, start_s: float | None, tenants) -> None:
        try:
            ray.get(self.placement_group.ready(), timeout=600 if start_s is None else start_s)
            addr, port = ray.get(self.ranks[0].rendezvous_address.remote(), timeout=start_s)
            infos = ray.get([r.start.remote(model, settings, addr, port) for r in self.ranks], timeout=start_s)
            self.info: ReplicaInfo = infos[0]
            self._following = [r.follow.remote() for r in self.ranks[1:]]
            started = (
                self.leader.start_engine.remote(engine, secret, market, directory, tenants)
                if engine is not None
                else None
            )
            self.addresses = ray.get(started, timeout=start_s) if started is not None else {}
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the replica's {len(self.ranks)} rank(s) were not placed and started within {start_s} s "
                "(no node has room for its bundle, or loading the model hangs)"
            ) from None

    def __getstate__(self) -> dict:
        """Pickled (a restartable controller saves its replicas): the followers' running calls belong to the
        process that made them, not to whoever unpickles this."""
        return {**self.__dict__, "_following": []}

    @property
    def leader(self):
        return self.ranks[0]

    def execute(self, batch: ForwardBatch) -> list[RequestOutput]:
        return ray.get(self.leader.execute.remote(batch))

    def shutdown(self) -> None:
        """Stop the engine and the ranks, and give their resources back (also when a rank died: Ray frees a dead
        actor's CPUs, but not the placement group's bundle)."""
        with contextlib.suppress(ray.exceptions.RayError):  # a hung rank (GetTimeoutError too) is killed as it is
            ray.get(self.leader.stop.remote(), timeout=STOP_S)
            ray.get(self._following, timeout=STOP_S)
        for r in self.ranks:
            ray.kill(r)
        if self._own_placement:
            remove_placement_group(self.placement_group)


def replica_placement(
    replicas: int,
    tensor_parallel_size: int,
    cpus_per_rank: int,
    use_gpu: bool,
    strategy: str = "SPREAD",
    resources: dict[str, float] | None = None,
    detached: bool = False,
) -> PlacementGroup:
    """A placement group with one bundle per replica, each holding a whole tensor-parallel group (a bundle never
    spans nodes). ``SPREAD`` puts replicas on different nodes where it can, ``STRICT_SPREAD`` always (or never
    becomes ready), ``PACK`` on as few nodes as fit. ``resources``: custom Ray resources each bundle takes too (a
    model kept to the nodes that declare them); ``detached``: it outlives its creator."""
    bundle = {**(resources or {}), "CPU": cpus_per_rank * tensor_parallel_size}
    if use_gpu:
        bundle["GPU"] = tensor_parallel_size
    lifetime = "detached" if detached else None
    return placement_group([dict(bundle) for _ in range(replicas)], strategy=strategy, lifetime=lifetime)
