"""The launcher's records: one per instance, and the hosts it places instances on."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from pie_cluster.hosts.node_host import InstanceLimits, NodeServices
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
