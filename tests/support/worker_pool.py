"""Test helper: a sandbox worker pool driven as the trusted host drives it, without Ray (real bubblewrap workers)."""

from __future__ import annotations

import asyncio
import tempfile
import textwrap
from pathlib import Path

from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox.pool import HostSide, WorkerPool
from pie_cluster.hosts.sandbox.protocol import InstanceSpec, ProgramRef
from pie_cluster.hosts.sandbox.view import Relays, SandboxView, build_view
from pie_cluster.instance import InstanceLimits, InstanceSetup
from pie_cluster.programs.program import Program
from support.sdk_host import TRUST


class Host:
    """The host's side of the pool: events collected per instance, session messages answered from a queue."""

    def __init__(self):
        self.events: dict[str, list[tuple[str, object]]] = {}
        self.ended: dict[str, asyncio.Event] = {}
        self.inbox: dict[str, asyncio.Queue] = {}

    def side(self) -> HostSide:
        return HostSide(self.emit, self.receive, lambda instance: None)

    def emit(self, instance: str, kind: str, value) -> None:
        self.events.setdefault(instance, []).append((kind, value))
        if kind in ("return", "error"):
            self.ended.setdefault(instance, asyncio.Event()).set()

    async def receive(self, instance: str, kind: str):
        return await self.inbox.setdefault(instance, asyncio.Queue()).get()

    async def outcome(self, instance: str, timeout: float = 30) -> tuple[str, object]:
        await asyncio.wait_for(self.ended.setdefault(instance, asyncio.Event()).wait(), timeout)
        return self.events[instance][-1]


async def launch(
    pool: WorkerPool,
    user: str,
    instance: str,
    source: str,
    input: dict | None = None,
    view: SandboxView | None = None,
    deadline_s: float | None = None,
    isolated: bool = False,
) -> None:
    program = Program.from_upload(f"{instance}.py", textwrap.dedent(source).encode())
    ref = ProgramRef(program.id, program.name, program.version, program.entry)
    capability = TRUST.instance(user, instance)["capability"]
    limits = InstanceLimits(deadline_s=deadline_s)
    setup = InstanceSetup(instance, user, capability, view.endpoints if view else {}, limits=limits)
    spec = InstanceSpec(setup, ref, input or {})
    await pool.start(user, program, spec, isolated=isolated)


WAITS = """
from inferlet import session
async def main(input):
    return "bob got " + await session.receive()
"""


def run(test, config: SandboxConfig | None = None, endpoints: dict | None = None) -> None:
    """``test(pool, host, view)`` against a fresh pool whose workers reach ``endpoints`` (through relays)."""

    async def body(tmp):
        host = Host()
        pool = WorkerPool(config or SandboxConfig(stall_s=5), tmp, host.side())
        relays = Relays(tmp)
        view = await build_view(endpoints or {}, (), relays)
        pool.set_view(view)
        try:
            await test(pool, host, view)
        finally:
            await pool.close()
            relays.close()

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(body(Path(tmp)))
