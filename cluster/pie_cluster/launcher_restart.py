"""What a launcher that Ray restarts gets back, and from where.

The launcher is restarted in place when its process dies (``max_restarts``). It keeps in the GCS's key-value store
(``GcsStore``) what it cannot ask anyone for: where its program store is on disk and which user holds which
program, the host pool the controller last gave it, and the nodes being drained. The running instances it asks of
the hosts, which keep each one's events and inbox and know what runs on them (``InferletHost.live``). Lost with the
old process: the list of finished instances, launches that were waiting for an admission slot, and the endings
hosts reported while it was down (those instances are no longer listed; their events stay readable on their host).
The cluster's own programs run by an ingress replica are its to finish; the launcher no longer counts them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import ray
import ray.exceptions
from pie_workers.deadlines import HOST_S, NoAnswer, answer

from pie_cluster.durable import GcsStore
from pie_cluster.instance_record import HostPool, InstanceRecord
from pie_cluster.program_store import ProgramStore
from pie_cluster.programs import Program


@dataclass
class LauncherState:
    """What is saved: the program store's directory, the controller's host pool, the nodes being drained."""

    store: str
    pool: HostPool | None = None
    draining: set[str] = field(default_factory=set)


class LauncherMemory:
    """The launcher's saved state, under its actor id (the same across its restarts)."""

    def __init__(self) -> None:
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        key = ray.get_runtime_context().get_actor_id()
        self._state = GcsStore("pie-launcher", f"{key}/state")
        self.holds = GcsStore("pie-launcher", f"{key}/holds")

    def load(self) -> LauncherState | None:
        return self._state.get(()) if self.restarted else None

    def save(self, state: LauncherState) -> None:
        self._state.put((), state)


async def running_on_hosts(pool: HostPool, programs: ProgramStore, builtins: dict[str, Program]) -> list:
    """Records of the instances the pool's hosts run (a host that does not answer contributes none)."""
    by_id = {program.id: program for program in builtins.values()}
    records = []
    for node, host in pool.hosts.items():
        with contextlib.suppress(ray.exceptions.RayError, NoAnswer):
            for live in await answer(host.live.remote(), f"the inferlet host on node {node}", HOST_S):
                program = by_id.get(live["program"]) or programs.get(live["user"], live["program"])
                if program is not None:
                    record = InstanceRecord(live["id"], live["user"], program, live["input"], node, host, False)
                    record.settled.set()
                    records.append(record)
    return records
