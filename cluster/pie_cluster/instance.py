"""One instance's records, from its launch to the process that runs it.

* ``Launch`` — what was asked: the instance's id, its user, its program, its input, its limits, when. It is the same
  record wherever the instance goes: the launcher books it (``launcher.records.InstanceRecord`` is a launch and where
  and how it runs), saves it while it waits for an admission slot (``launcher.recovery.SavedLaunch``), hands it to
  an inferlet host (``InferletHost.start``), which keeps it with the instance's channel and tells a restarted
  launcher of it (``HostedInstance``); an ingress replica that runs one itself reports its launch (its input left
  out: the launcher lists what ``pie list`` shows, never a prompt).
* ``InstanceSetup`` — who it is to the replicas and the bus (a capability its host minted) and what it reaches,
  made by whatever runs it; a sandboxed worker gets it in an ``InstanceSpec`` (``hosts.sandbox.protocol``).

Imported by sandboxed workers too: nothing here needs Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint


@dataclass(frozen=True)
class InstanceLimits:
    """What an instance may use: wall time, market credits, generated tokens (None: the cluster's default)."""

    deadline_s: float | None = None
    endowment: float | None = None
    token_budget: int | None = None


@dataclass(frozen=True)
class Launch:
    """What was launched, as every part that holds the instance knows it."""

    id: str
    user: str
    program: str  # its program's id
    input: dict
    limits: InstanceLimits = InstanceLimits()
    created: float = field(default_factory=time.time)


@dataclass(frozen=True)
class HostedInstance:
    """An instance a host runs, or keeps the ending of while its channel is kept: what a restarted launcher learns
    of it from ``InferletHost.live``."""

    launch: Launch
    ending: tuple[str, str | bytes] | None = None  # its terminal event's kind and value; None while it runs


@dataclass(frozen=True)
class InstanceSetup:
    """Who an instance is and what it reaches: the same whether it runs in the trusted host or in a worker."""

    instance_id: str
    username: str
    capability: str  # minted by the trusted host; the replicas and bus shards take the identity from it alone
    endpoints: dict[str, ModelEndpoint]
    bus: tuple[str, ...] = ()
    mcp_servers: dict[str, ServerSpec] = field(default_factory=dict)
    limits: InstanceLimits = InstanceLimits()
    opening_balance: float | None = None  # its wallet's credits, when the trusted side opened it before the start
