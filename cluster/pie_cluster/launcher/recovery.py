"""What a launcher that Ray restarts gets back, and from where.

The launcher is restarted when its process dies (``max_restarts``), on another node if its own is lost. It keeps in
the GCS's key-value store (``GcsStore``) what it cannot ask anyone for: where its program store is on disk, which
user holds which program and the programs' content (a restart on another node reads them from there), the host pool
the controller last gave it, the nodes being drained, and the launches waiting for an admission slot (saved when
one starts waiting, deleted when it starts or ends: only an overloaded cluster writes them). The instances it asks
of the hosts, which keep each one's events and inbox (``InferletHost.live``): those running, and those that ended as
long as their host keeps their events (``[launcher] event_buffer`` / ``keep_finished``), so endings reported while
it was down are learned too. The cluster's own programs run by an ingress replica are its to finish; the launcher no
longer counts them once they run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import ray
import ray.exceptions
from pie_workers.deadlines import HOST_S, NoAnswer, answer

from pie_cluster.gcs_store import GcsStore
from pie_cluster.instance import Launch
from pie_cluster.launcher.records import HostPool, InstanceRecord
from pie_cluster.programs.program import Program
from pie_cluster.programs.store import ProgramStore


@dataclass
class LauncherState:
    """What is saved: the program store's directory, the controller's host pool, the nodes being drained."""

    store: str
    pool: HostPool | None = None
    draining: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class SavedLaunch:
    """A launch waiting for an admission slot, as saved: enough to queue it again after a restart."""

    launch: Launch
    node_id: str
    dedicated: bool

    @classmethod
    def of(cls, instance: InstanceRecord) -> SavedLaunch:
        return cls(instance.launch, instance.node_id, instance.dedicated)

    def record(self, program: Program, node: str, pooled_host) -> InstanceRecord:
        """The record of this launch, queued again on ``node`` (its pooled host runs it unless it is dedicated)."""
        host = None if self.dedicated else pooled_host
        return InstanceRecord(self.launch, program, node, host, self.dedicated, queued=True)


class LauncherMemory:
    """The launcher's saved state, under its actor id (the same across its restarts)."""

    def __init__(self) -> None:
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        key = ray.get_runtime_context().get_actor_id()
        self._state = GcsStore("pie-launcher", f"{key}/state")
        self.holds = GcsStore("pie-launcher", f"{key}/holds")
        self.waiting = GcsStore("pie-launcher", f"{key}/waiting")  # instance id -> SavedLaunch
        self.programs = GcsStore("pie-launcher", f"{key}/programs")  # program id -> Program (see ProgramStore)

    def load(self) -> LauncherState | None:
        return self._state.get(()) if self.restarted else None

    def save(self, state: LauncherState) -> None:
        self._state.put((), state)


def program_of(program_id: str, user: str, programs: ProgramStore, builtins: dict[str, Program]) -> Program | None:
    """The program of that id: a built-in (``builtins``: by id), else one ``user`` stored; None if it is gone."""
    return builtins.get(program_id) or programs.get(user, program_id)


async def known_to_hosts(pool: HostPool, programs: ProgramStore, builtins: dict[str, Program]) -> list:
    """Records of the instances the pool's hosts run or keep the ending of, oldest first on each host (a host that
    does not answer contributes none)."""
    records = []
    for node, host in pool.hosts.items():
        with contextlib.suppress(ray.exceptions.RayError, NoAnswer):
            for live in await answer(host.live.remote(), f"the inferlet host on node {node}", HOST_S):
                program = program_of(live.launch.program, live.launch.user, programs, builtins)
                if program is not None:
                    records.append(InstanceRecord.hosted(live, program, node, host))
    return records
