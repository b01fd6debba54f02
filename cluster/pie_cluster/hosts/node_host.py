"""Where inferlets run: one trusted async Ray actor per node, which hands each instance to where it belongs.

Uploaded programs run in their user's sandboxed worker processes (``pie_cluster.hosts.sandbox``): the host never runs
user code itself while the sandbox is on. The cluster's own programs (the OpenAI serving program) run here as
asyncio tasks, as everything does when the operator turns the sandbox off. Either way each instance gets a
capability minted here with the cluster's secret, naming its user and itself, which the replicas and bus shards
check. Its events and inbox live here (``hosts.events.Channel``): clients read them from this actor, and only its
ending goes to the launcher (batched per event-loop turn). With the sandbox off, a program that asks for
isolation or its own ``runtime_env`` gets a dedicated host.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass, field

from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint
from pie_workers.wire import capability

from pie_cluster.config import SandboxConfig
from pie_cluster.hosts import stdio
from pie_cluster.hosts.description import HostDescription
from pie_cluster.hosts.events import Channels, Ending, EventBatch
from pie_cluster.hosts.model_files import local_endpoints
from pie_cluster.hosts.replica_relay import ReplicaRelays, failing_over
from pie_cluster.hosts.revocations import Revoker
from pie_cluster.hosts.run import move_bus, serve_instance
from pie_cluster.hosts.sandbox.hosting import Sandbox
from pie_cluster.instance import HostedInstance, InstanceSetup, Launch
from pie_cluster.limits import ChannelLimits
from pie_cluster.programs.program import Program

# An instance without a deadline proves who it is for this long. Its end revokes it sooner on every replica and bus
# shard (``revocations.py``); the lifetime still bounds what a revocation cannot reach (a replica or shard started
# anew after it, a revocation lost with its target) and must outlast the longest instance, since none is renewed.
CAPABILITY_TTL_S = 7 * 24 * 3600.0
CAPABILITY_MARGIN_S = 60.0  # beyond its deadline: the instance's last calls (closing its contexts) still count


class _ClientSession:
    """``inferlet.session`` for a hosted instance: events out and the client's messages in, both on the host."""

    def __init__(self, host: InferletHost, instance_id: str):
        self._host, self._id = host, instance_id

    def send(self, text: str) -> None:
        self._host.emit(self._id, "message", text)

    def send_file(self, data: bytes) -> None:
        self._host.emit(self._id, "file", bytes(data))

    async def receive(self) -> str:
        return await self._host.receive(self._id, "message")

    async def receive_file(self) -> bytes:
        return await self._host.receive(self._id, "file")


@dataclass(frozen=True)
class NodeServices:
    """What an inferlet on one node reaches; fixed while the cluster runs, so a host gets it once."""

    endpoints: dict[str, ModelEndpoint]  # model name -> a replica (ipc on this node, else tcp)
    # model name -> every replica as reached from this node, in replica order; the ingress picks among them per
    # request for the programs it runs itself (ingress.routing), node hosts use ``endpoints``
    replicas: dict[str, tuple[ModelEndpoint, ...]] = field(default_factory=dict)
    bus: tuple[str, ...] = ()  # message bus shard addresses from this node
    mcp_servers: dict[str, ServerSpec] = field(default_factory=dict)  # name -> how inferlets reach it
    market: object | None = None  # the KV-page market actor: every instance has a wallet there while it runs
    model_files: dict[str, object] = field(default_factory=dict)  # model name -> Ray ref to its tokenizer files
    # every replica's leader and bus shard (actor handles): told which instances ended (``revocations.py``)
    revokers: tuple = ()


class InferletHost:
    """Runs instances: uploaded programs in the sandboxed workers of their user (``pie_cluster.hosts.sandbox``), trusted
    ones (the built-in programs, or everything when the sandbox is off) as tasks in this process."""

    def __init__(
        self,
        launcher,
        services: NodeServices,
        secret: bytes,
        sandbox: SandboxConfig | None = None,
        channels: ChannelLimits | None = None,
    ):
        self.launcher = launcher
        self.services = services
        self._secret = secret
        self._endpoints: dict[str, ModelEndpoint] | None = None  # services.endpoints as seen from this node
        self._tasks: dict[str, asyncio.Task] = {}
        self._abort_reasons: dict[str, str] = {}
        self._channels = Channels(channels or ChannelLimits(), ended=self._ended, exceeded=self._end_now)
        self._revoker = Revoker(lambda: self.services.revokers)
        self._sandbox = Sandbox(sandbox, self) if sandbox is not None and sandbox.enabled else None
        self._relays = ReplicaRelays(self._replica_addresses)
        stdio.install_router()
        gc.freeze()  # the imports live as long as the host: full collections need not scan them (see RankWorker.start)

    def _ended(self, endings: list[Ending]) -> None:
        """A turn's endings: to the launcher, and their capabilities revoked on every replica and shard."""
        self.launcher.ended.remote(endings)
        self._revoker.ended(ending.instance for ending in endings)

    async def ready(self) -> bool:
        """Answers as soon as the host is up (``pie status`` asks it)."""
        return True

    async def describe(self) -> HostDescription:
        """How this host runs uploaded programs (``pie status``)."""
        if self._sandbox is None:
            return HostDescription("off")
        return HostDescription("bubblewrap", self._sandbox.pool.stats())

    async def set_services(self, services: NodeServices) -> None:
        """What new instances reach from now on (a replica was replaced or a bus shard moved: addresses changed)."""
        self.services, self._endpoints = services, None
        if self._sandbox is not None:
            self._sandbox.services_changed(services.bus)
        else:
            move_bus(services.bus)

    async def lifetime(self) -> None:
        """Never answers: the launcher keeps this call open to learn at once that the host died (it fails)."""
        await asyncio.Event().wait()

    async def start(self, launch: Launch, program: Program, trusted: bool = False) -> None:
        """Begin running the launched instance of ``program``; returns at once (its events report how it goes).
        ``trusted``: one of the cluster's own programs, run in this process even when the sandbox is on."""
        channel = self._channels.open(launch.id, launch.user)
        channel.launch = launch
        here = self._sandbox is None or trusted
        work = self._run(launch, program) if here else self._hand_over(launch, program)
        self._tasks[launch.id] = asyncio.get_running_loop().create_task(work)

    async def live(self) -> list[HostedInstance]:
        """The instances here, the ended ones (with their ending) as long as their channel is kept: what a restarted
        launcher asks every host, so it learns too the endings it was told before it died or while it was down."""
        return [
            HostedInstance(channel.launch, None if (end := channel.log.terminal) is None else (end.kind, end.value))
            for channel in self._channels.all()
            if channel.launch is not None
        ]

    async def abort(self, instance_id: str, reason: str = "aborted") -> bool:
        return self._end_now(instance_id, reason)

    def _end_now(self, instance_id: str, reason: str) -> bool:
        """Cancel the instance, which then ends with an error saying ``reason``; False if it is not running here."""
        if self._sandbox is not None and self._sandbox.pool.abort(instance_id, reason):
            return True
        task = self._tasks.get(instance_id)  # running here, or still being handed to a worker
        if task is None or task.done():
            return False
        self._abort_reasons[instance_id] = reason
        task.cancel()
        return True

    async def events(self, user: str, instance_id: str, since: int = 0, timeout: float = 10.0) -> EventBatch:
        """Events numbered ``since`` and later, waiting up to ``timeout`` s for one (a long poll)."""
        channel = self._channels.own(user, instance_id)
        return channel.events(await channel.log.wait(since, min(max(timeout, 0.0), 60.0)), since)

    async def send(self, user: str, instance_id: str, kind: str, value: str | bytes) -> None:
        """The client's message (``kind`` "message") or file ("file") for the instance's ``inferlet.session``."""
        self._channels.deliver(user, instance_id, kind, value)

    async def receive(self, instance_id: str, kind: str):
        """What the instance's client sends next (its session, here or in its sandboxed worker)."""
        channel = self._channels.find(instance_id)
        if channel is None:
            raise RuntimeError(f"instance {instance_id} has ended")
        return await channel.receive(kind)

    async def _setup(self, launch: Launch) -> InstanceSetup:
        services = self.services
        if self._endpoints is None:
            endpoints = await local_endpoints(services.endpoints, services.model_files)
            self._endpoints = {
                name: failing_over(e, self._replica_addresses(name), await self._relays.address_for(name))
                for name, e in endpoints.items()
            }
        limits = launch.limits
        ttl = (limits.deadline_s or CAPABILITY_TTL_S) + CAPABILITY_MARGIN_S
        minting = self._revoker.minted(launch.id, ttl)
        return InstanceSetup(
            instance_id=launch.id,
            username=launch.user,
            capability=capability.mint(
                self._secret,
                launch.user,
                launch.id,
                ttl,
                models=tuple(self._endpoints),
                token_budget=limits.token_budget,
                minting=minting,
            ),
            endpoints=self._endpoints,
            bus=services.bus,
            mcp_servers=services.mcp_servers,
            limits=limits,
        )

    # -- one instance, in this process or handed to a sandboxed worker ----------------------------------------------

    async def _run(self, launch: Launch, program: Program):
        instance_id = launch.id
        try:
            try:
                setup = await self._setup(launch)
            except Exception as e:  # its models' files could not be fetched to this node
                self.emit(instance_id, "error", f"the host could not prepare the instance: {e}")
                return
            await serve_instance(
                program,
                program.load_main,
                launch.input,
                setup,
                lambda kind, value: self.emit(instance_id, kind, value),
                _ClientSession(self, instance_id),
                aborted=lambda: self._abort_reasons.pop(instance_id, "aborted"),
                market=self.services.market,
            )
        finally:
            self._tasks.pop(instance_id, None)

    async def _hand_over(self, launch: Launch, program: Program):
        """Give the instance to its user's worker; if that fails (or it is aborted first), it ends here."""
        try:
            await self._sandbox.start(program, launch.input, await self._setup(launch))
        except asyncio.CancelledError:
            self.emit(launch.id, "error", self._abort_reasons.pop(launch.id, "aborted"))
        except Exception as e:
            self.emit(launch.id, "error", f"no sandboxed worker could take the instance: {e}")
        finally:
            self._tasks.pop(launch.id, None)

    def emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        self._channels.emit(instance_id, kind, value)

    def _replica_addresses(self, model: str) -> list[str]:
        """The model's replicas as reached from this node, this node's own first (where inferlets fail over to)."""
        services = self.services
        mine = [services.endpoints[model].address] if model in services.endpoints else []
        return list(dict.fromkeys([*mine, *(r.address for r in services.replicas.get(model, ()))]))
