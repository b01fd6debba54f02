"""The trusted host's sandboxed side: its worker pool, its relays, and each sandboxed instance's wallet.

A worker holds no Ray handle, so what the host did for an in-process instance through ``run_inferlet`` is done
here around the worker: the market wallet is opened before the instance starts and closed before its ending event
goes out (its contexts are released by then: the worker closes them, or the replica does when the worker's
connection drops), and the client's messages are handed to the worker from the host's inbox.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import shutil
from pathlib import Path

import ray.exceptions
from pie_workers.cache import cache_root
from pie_workers.deadlines import NoAnswer

from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox.bwrap import probe
from pie_cluster.hosts.sandbox.pool import HostSide, WorkerPool
from pie_cluster.hosts.sandbox.protocol import InstanceSpec, ProgramRef
from pie_cluster.hosts.sandbox.view import Relays, SandboxView, build_view
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.instance import InstanceSetup
from pie_cluster.programs.program import Program


class Sandbox:
    def __init__(self, config: SandboxConfig, host):
        probe(config)  # a node whose kernel refuses the sandbox says so at once, naming the fix
        self._host = host
        self.directory = _private_directory()
        self._relays = Relays(self.directory)
        self.pool = WorkerPool(config, self.directory, HostSide(self._emit, self._receive, self._ended))
        self._view: SandboxView | None = None  # None: to be built (again) from the services at the next launch
        self._building = asyncio.Lock()
        self._wallets: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self, program: Program, input: dict, setup: InstanceSetup) -> None:
        async with self._building:  # concurrent launches after a change build the view once
            if self._view is None:
                self._view = await build_view(setup.endpoints, setup.bus, self._relays)
                self.pool.set_view(self._view)
        seen = dataclasses.replace(setup, endpoints=self._view.endpoints, bus=self._view.bus)
        market = self._host.services.market
        if market is not None:
            opening = await wallet_calls(market).join(setup.instance_id, setup.limits.endowment)
            self._wallets.add(setup.instance_id)
            seen = dataclasses.replace(seen, opening_balance=opening)
        spec = InstanceSpec(seen, ProgramRef(program.id, program.name, program.version, program.entry), input)
        try:
            await self.pool.start(setup.username, program, spec, program.isolated)
        except BaseException:
            self._ended(setup.instance_id)
            raise

    def services_changed(self, bus: tuple[str, ...]) -> None:
        """A replica was replaced or a bus shard moved: the next launch builds the view anew (and the pool retires
        the workers); the running workers' bus sockets reconnect through their relays to where the shards are now."""
        self._view = None
        self._relays.point_bus(bus)

    def _emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        """Events go out as they come, an ending once the instance's wallet is closed: a client that sees how it
        ended then also sees the market settled."""
        if kind in ("return", "error") and instance_id in self._wallets:
            self._wallets.discard(instance_id)
            self._spawn(self._leave_then_emit(instance_id, kind, value))
        else:
            self._host.emit(instance_id, kind, value)

    async def _leave_then_emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        try:
            await self._leave(instance_id)
        finally:
            self._host.emit(instance_id, kind, value)

    async def _receive(self, instance_id: str, kind: str):
        return await self._host.receive(instance_id, kind)

    def _ended(self, instance_id: str) -> None:
        if instance_id in self._wallets:  # it ended without an ending event (it never started)
            self._wallets.discard(instance_id)
            self._spawn(self._leave(instance_id))

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _leave(self, instance_id: str) -> None:
        with contextlib.suppress(ray.exceptions.RayError, NoAnswer):  # a wallet the market lost or cannot close now
            await wallet_calls(self._host.services.market).leave(instance_id)


def _private_directory() -> Path:
    """``<cache>/sandbox/host-<pid>``, private to the host, removed when it exits; those of hosts that died without
    removing theirs are removed here."""
    root = cache_root() / "sandbox"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("host-*"):
        with contextlib.suppress(ValueError):
            if not _alive(int(old.name.removeprefix("host-"))):
                shutil.rmtree(old, ignore_errors=True)
    directory = root / f"host-{os.getpid()}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700)
    atexit.register(shutil.rmtree, directory, True)
    return directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
