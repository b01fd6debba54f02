"""The launcher's records: one per instance, and the hosts it places instances on."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pie_cluster.inferlet_host import InstanceLimits, NodeServices
from pie_cluster.programs import Program


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
