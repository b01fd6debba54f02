"""How one host bounds each of its workers as a whole, not only process by process.

Two modes, chosen once per host (``pie status`` shows which):

* ``cgroup``: the host may make cgroups, v2 or v1 (``cgroups.py``). The kernel bounds each worker's memory
  (``worker_memory_mib``), CPUs (``worker_cpus``) and processes and threads (``max_processes``), all its processes
  together.
* ``rlimit``: it may not (a container that delegates none, a read-only cgroup file system). Each process of a
  worker has kernel limits (address space, CPU time, file size; processes per uid, a uid of its own on a root
  host), and the host's census, once a second, sums the processes under each worker's bubblewrap (its PID
  namespace holds them all, whatever uid they run as) and ends a worker past ``max_processes`` tasks or
  ``worker_memory_mib`` of private resident memory. CPUs are not bounded in this mode, only CPU time.

Both modes keep the per-process limits: an allocation past ``memory_mib`` raises ``MemoryError`` in the inferlet
that made it rather than ending its worker.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox import cgroups
from pie_cluster.hosts.sandbox.cgroup_common import CgroupLimits


@dataclass
class Usage:
    """What one worker holds right now: tasks (processes and threads), CPU seconds used, private memory."""

    tasks: int = 0
    cpu_s: float = 0.0
    memory_mib: float = 0.0
    out_of_memory: bool = False  # the kernel killed one of its processes for the worker's memory limit (v1)


class WorkerLimits:
    def __init__(self, config: SandboxConfig):
        self._config = config
        if config.cgroups:
            self._tree, self.how = cgroups.detect()
        else:
            self._tree, self.how = None, "cgroups are off ([sandbox] cgroups = false)"
        self.mode = "cgroup" if self._tree is not None else "rlimit"
        self._census_at, self._census = float("-inf"), None

    def rlimits(self) -> dict[str, int]:
        """The kernel limits each process of a worker sets on itself before running user code (``worker_main``)."""
        config = self._config
        return {
            "RLIMIT_AS": config.memory_mib << 20,
            "RLIMIT_CPU": config.cpu_seconds,
            "RLIMIT_NPROC": config.max_processes,
            "RLIMIT_FSIZE": config.max_file_mib << 20,
            "RLIMIT_CORE": 0,
        }

    def confine(self, slot: int, argv: list[str]) -> list[str]:
        """``argv``, started ``nice`` steps below the host's CPU priority, so that no tenant's busy loop (nor a
        worker's start) starves the host that serves every user, and inside worker ``slot``'s own cgroup where
        there are cgroups."""
        config = self._config
        argv = ["nice", "-n", str(config.nice), *argv] if config.nice else argv
        if self._tree is None:
            return argv
        limits = CgroupLimits(config.worker_memory_mib, config.worker_cpus, config.max_processes)
        self._tree.make(_name(slot), limits)
        return self._tree.join(_name(slot), argv)

    async def usage(self, slot: int, pid: int, now: float) -> Usage:
        """Worker ``slot``'s (its bubblewrap is ``pid``) usage, the /proc census taken at most once a second, in a
        thread: reading every process's stat file takes tens of ms that the host's loop owes to every user."""
        if self._tree is not None:
            got = self._tree.usage(_name(slot))
            return Usage(got.tasks, got.cpu_s, got.memory_mib, got.out_of_memory)
        if self._census is None or now - self._census_at >= 1.0:
            self._census_at, self._census = now, asyncio.ensure_future(asyncio.to_thread(_Census.take))
        census = await asyncio.shield(self._census)  # one census for every worker's watch that asks this second
        return census.below(pid)

    def exceeded(self, usage: Usage) -> str | None:
        """Why a worker with ``usage`` must be ended, if it must: the host ends it (a process-limited worker left
        with a swarm that spins failing to fork; memory, where no cgroup bounds it)."""
        config = self._config
        if usage.tasks >= config.max_processes:
            return (
                f"it reached its limit of {config.max_processes} processes and threads (a fork bomb in one of this "
                "user's inferlets?)"
            )
        if self._tree is None and usage.memory_mib > config.worker_memory_mib:
            return (
                f"its processes together held {usage.memory_mib:.0f} MiB of memory, past its limit of "
                f"{config.worker_memory_mib} MiB for the worker as a whole ([sandbox] worker_memory_mib)"
            )
        if usage.out_of_memory:
            return self._out_of_memory()
        return None

    def _out_of_memory(self) -> str:
        return (
            f"its processes together went past its limit of {self._config.worker_memory_mib} MiB of memory for "
            "the worker as a whole ([sandbox] worker_memory_mib)"
        )

    def released(self, slot: int) -> str | None:
        """Worker ``slot`` has exited: why the kernel ended it, if a whole-worker limit did; its cgroup is removed."""
        if self._tree is None:
            return None
        name = _name(slot)
        why = None
        if self._tree.out_of_memory(name):
            why = self._out_of_memory()
        self._tree.remove(name)
        return why

    def close(self) -> None:
        if self._tree is not None:
            self._tree.close()


def _name(slot: int) -> str:
    return f"worker-{slot}"


@dataclass
class _Census:
    """Every process's parent and /proc/<pid>/stat fields, to sum what lies under a worker's bubblewrap."""

    children: dict[int, list[int]]
    stats: dict[int, list[str]]

    @classmethod
    def take(cls) -> _Census:
        children: dict[int, list[int]] = {}
        stats: dict[int, list[str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it exited while being read
                continue
            pid = int(entry.name)
            stats[pid] = fields
            children.setdefault(int(fields[1]), []).append(pid)
        return cls(children, stats)

    def below(self, root: int) -> Usage:
        usage = Usage()
        tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        todo = list(self.children.get(root, ()))
        while todo:
            pid = todo.pop()
            todo += self.children.get(pid, ())
            fields = self.stats[pid]
            usage.tasks += int(fields[17])  # num_threads
            usage.cpu_s += sum(map(int, fields[11:15])) / tick  # utime, stime and those of its reaped children
            try:  # resident minus file-backed and shared pages: what this process holds privately
                resident, shared = map(int, Path(f"/proc/{pid}/statm").read_text().split()[1:3])
            except (OSError, ValueError):
                continue
            usage.memory_mib += (resident - shared) * page / (1 << 20)
        return usage
