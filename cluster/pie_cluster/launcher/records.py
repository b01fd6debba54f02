"""The launcher's records: one per instance, the hosts it places instances on, and what it and the ingress replicas
that run instances themselves say to each other about admission slots (``launcher/leases.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from pie_cluster.hosts.events import Ending
from pie_cluster.hosts.node_host import NodeServices
from pie_cluster.instance import HostedInstance, Launch
from pie_cluster.overloaded import Overloaded
from pie_cluster.programs.program import Program


@dataclass
class InstanceRecord:
    """What the launcher knows of one instance: its launch, its program, where it runs, and how it ended."""

    launch: Launch
    program: Program
    node_id: str
    host: object | None = None  # its inferlet host actor (None until a dedicated one is made at its start)
    dedicated: bool = False
    ended: float | None = None
    ending: tuple[str, str | bytes] | None = None  # its terminal event (kind, value), once it ended
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # its host took it, or it ended: locate answers
    queued: bool = False  # waiting for an admission slot
    runner: str | None = None  # the ingress replica that runs it (one of the cluster's own programs), if one does
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.launch.id

    @property
    def user(self) -> str:
        return self.launch.user

    @classmethod
    def run_by(cls, runner: str, node: str, launch: Launch, program: Program) -> InstanceRecord:
        """One an ingress replica began (``launch``, from its report, without its input): listed, never placed by the
        launcher."""
        instance = cls(launch, program, node, runner=runner)
        instance.settled.set()
        return instance

    @classmethod
    def hosted(cls, hosted: HostedInstance, program: Program, node: str, host) -> InstanceRecord:
        """One a host says it runs or ran (what a restarted launcher learns)."""
        instance = cls(hosted.launch, program, node, host)
        if hosted.ending is not None:
            instance.ending, instance.ended = hosted.ending, time.time()
            instance.finished.set()
        instance.settled.set()
        return instance

    def listed(self) -> ListedInstance:
        end = self.ended or time.time()
        if self.ending is not None:
            status = {"return": "finished", "error": "failed"}[self.ending[0]]
        else:
            status = "queued" if self.queued else "running"
        created = self.launch.created
        return ListedInstance(
            self.id, self.program.label, status, self.node_id, self.launch.input, created, round(end - created, 3)
        )


@dataclass(frozen=True)
class ListedInstance:
    """One instance as the launcher's ``list`` answers it (``GET /v1/instances``, `pie list`)."""

    id: str
    program: str  # its program's name@version
    status: str  # queued, running, finished or failed
    node: str
    input: dict
    created: float
    elapsed_s: float


@dataclass(frozen=True)
class LauncherStats:
    """The launcher's counts, as `pie status` shows them under ``launcher``."""

    launched: int  # instances launched since it started, the ingress replicas' included
    calls: dict[str, int]  # calls taken from clients, hosts and ingress replicas, by method
    ingress_replicas: dict[str, int]  # instances each ingress replica has run
    running: int  # admission slots taken
    queued: int  # launches and asks waiting for one
    programs: int  # programs stored
    sandbox: str  # "bubblewrap" or "off"


@dataclass(frozen=True)
class Uploaded:
    """A stored program, as the launcher's ``upload`` answers it (``POST /v1/programs``)."""

    program: str  # its id, what launches name
    name: str  # name@version
    isolated: bool


@dataclass
class HostPool:
    """What the controller hands the launcher: a pooled host per node and what inferlets on each node reach."""

    hosts: dict[str, object]  # node id -> InferletHost actor
    services: dict[str, NodeServices]  # node id -> its models (ipc on that node, else tcp), bus, MCP, market
    secret: bytes  # the cluster's, for the dedicated hosts to mint their instances' capabilities with
    model_nodes: tuple[str, ...] = ()  # nodes that serve at least one replica: preferred for co-location

    def choose_node(self, asked: str | None, closed: dict[str, str], load: dict[str, int]) -> str:
        """Where a launch runs: the node ``asked`` for, else the least loaded open node (those that serve the models
        first). ``closed``: nodes that take no launch now, and why; ``load``: running instances per node."""
        if asked is not None:
            if asked in closed:
                raise RuntimeError(f"node {asked} takes no launches: {closed[asked]}")
            if asked not in self.hosts:
                raise ValueError(f"no inferlet host on node {asked!r}; nodes: {', '.join(sorted(self.hosts))}")
            return asked
        up = [n for n in self.hosts if n not in closed]
        if not up:
            raise RuntimeError("no node takes launches: every node's inferlet host is down or drained")
        preferred = [n for n in self.model_nodes if n in up] or up
        return min(preferred, key=lambda n: load.get(n, 0))

    def without(self, node: str) -> HostPool:
        """The pool once ``node`` is drained: no host there, and no services to give one."""
        hosts = {n: h for n, h in self.hosts.items() if n != node}
        services = {n: s for n, s in self.services.items() if n != node}
        return dataclasses.replace(self, hosts=hosts, services=services)


@dataclass(frozen=True)
class SlotAsk:
    """An ingress replica asks for one more admission slot for ``user``: a request of theirs found none free in its
    lease (``launcher/leases.py``). ``id`` names the ask while it waits in the queue."""

    id: str
    user: str


@dataclass(frozen=True)
class Granted:
    """The slot is the replica's: counted as running for the user until the replica gives it back."""


@dataclass(frozen=True)
class Queued:
    """The slot is not free now: the ask waits in the launcher's queue (``Launcher.slot`` waits for it)."""


@dataclass(frozen=True)
class Refused:
    """The launcher refused the ask: over the admission limits (``retry_after_s``: HTTP 429), or a request no
    launcher could take."""

    message: str
    retry_after_s: float | None = None

    def error(self) -> Exception:
        return (
            Overloaded(self.message, self.retry_after_s) if self.retry_after_s is not None else ValueError(self.message)
        )


@dataclass(frozen=True)
class RunOnHost:
    """The replica's node has no view of the models: the replica launches its requests on an inferlet host."""


SlotAnswer = Granted | Queued | Refused | RunOnHost


@dataclass(frozen=True)
class RunnerReport:
    """What an ingress replica tells the launcher, one message per event-loop turn that has news and at least every
    ``ingress.slot_lease.RENEW_S``: the instances it began and how others ended, the slots it gives back, and the
    slots it holds per user after that (what a restarted launcher counts again)."""

    runner: str
    node: str
    handle: object  # its Ray actor, pinged to learn that it died
    started: tuple[Launch, ...] = ()  # without their input, which is the request's prompt
    ended: tuple[Ending, ...] = ()
    returned: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    idle: dict[str, int] = field(default_factory=dict)  # of ``held``, how many no instance uses


@dataclass(frozen=True)
class RunnerOrders:
    """What the launcher asks of an ingress replica (its long poll, ``Launcher.orders``): instances to abort,
    whether launches wait for slots that it holds idle (it gives them back at once), and the version of the
    services its instances are to run with (a newer one: it fetches them again)."""

    aborts: tuple[str, ...] = ()
    reclaim: bool = False
    services: int = 0


@dataclass(frozen=True)
class RunnerServices:
    """What instances an ingress replica runs reach, the secret to mint their capabilities with, the version of
    both, and the deadline its instances run under (``[launcher] default_deadline_s``)."""

    services: NodeServices
    secret: bytes
    version: int
    deadline_s: float | None
