"""The launcher's records: one per instance, the hosts it places instances on, and the admissions of the instances
an ingress replica runs itself (what ``Launcher.admit_many`` takes and answers)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from pie_cluster.hosts.node_host import InstanceLimits, NodeServices
from pie_cluster.overloaded import Overloaded
from pie_cluster.programs.program import Program


@dataclass
class InstanceRecord:
    """What the launcher knows of one instance: whose, what, where it runs, and how it ended."""

    id: str
    user: str
    program: Program
    input: dict
    node_id: str
    host: object | None  # its inferlet host actor (None until a dedicated one is made at its start)
    dedicated: bool
    created: float = field(default_factory=time.time)
    ended: float | None = None
    ending: tuple[str, str | bytes] | None = None  # its terminal event (kind, value), once it ended
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # its host took it, or it ended: locate answers
    limits: InstanceLimits = field(default_factory=InstanceLimits)  # what it runs with
    queued: bool = False  # waiting for an admission slot
    runner: str | None = None  # the ingress replica that runs it (one of the cluster's own programs), if one does
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def summary(self) -> dict:
        end = self.ended or time.time()
        if self.ending is not None:
            status = {"return": "finished", "error": "failed"}[self.ending[0]]
        else:
            status = "queued" if self.queued else "running"
        return {
            "id": self.id,
            "program": self.program.label,
            "status": status,
            "node": self.node_id,
            "input": self.input,
            "created": self.created,
            "elapsed_s": round(end - self.created, 3),
        }


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
class AdmitRequest:
    """An instance of one of the cluster's own programs that an ingress replica asks to run in its own process (it
    names the instance, so it opens the instance's wallet while the launcher admits it)."""

    instance_id: str
    user: str
    program: str
    input: dict


@dataclass(frozen=True)
class Admitted:
    """The instance is the launcher's: it runs now, or waits for a slot (``queued``: ``Launcher.admitted`` waits on).
    ``ending``: it was aborted while it waited; ``services``: the version of the node's services it runs with;
    ``spare``: how many more its user may start now (the runner may begin those before their answer)."""

    id: str
    queued: bool
    ending: tuple[str, str | bytes] | None
    deadline_s: float | None
    services: int
    spare: int


@dataclass(frozen=True)
class Refused:
    """The launcher refused the admission: over the admission limits (``retry_after_s``: HTTP 429), or a request no
    launcher could take (a program that is not the cluster's, an id already taken)."""

    message: str
    retry_after_s: float | None = None

    def error(self) -> Exception:
        return (
            Overloaded(self.message, self.retry_after_s) if self.retry_after_s is not None else ValueError(self.message)
        )


@dataclass(frozen=True)
class RunOnHost:
    """The runner's node has no view of the models: the runner launches the instance on an inferlet host instead."""


AdmissionAnswer = Admitted | Refused | RunOnHost
