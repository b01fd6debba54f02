"""One cgroup v1 group per worker, on hosts whose controllers sit in v1 hierarchies this host may write (hybrid
hosts, and VMs and containers that mount them writable).

The worker's group exists once per hierarchy (memory, cpu, cpuacct and pids; one directory where two are mounted
together): ``memory.limit_in_bytes`` (and the same ``memory.memsw.limit_in_bytes``: no swap), ``cpu.cfs_quota_us``
(how many CPUs its processes together may keep busy), ``pids.max``; ``cpuacct.usage`` counts its CPU time. v1 has no
``memory.oom.group``: past its memory limit the kernel kills one of the worker's processes (the largest), so the
host, seeing the kill in ``memory.oom_control``, ends the rest of the worker within a second (``limits.exceeded``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from pie_cluster.hosts.sandbox.cgroup_common import (
    CPU_PERIOD_US,
    CgroupLimits,
    CgroupUsage,
    join_argv,
    lines,
    mounts,
    remove_stale,
    remove_tree,
    tree_name,
    write,
)

CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")


@dataclass(frozen=True)
class CgroupV1Tree:
    """``roots``: controller -> the group this host made in that controller's hierarchy."""

    roots: dict[str, Path]
    version = "v1"

    def _groups(self, name: str) -> list[Path]:
        return [root / name for root in dict.fromkeys(self.roots.values())]  # comounted controllers: once

    def make(self, name: str, limits: CgroupLimits) -> None:
        for group in self._groups(name):
            group.mkdir()
        memory = self.roots["memory"] / name
        write(memory / "memory.limit_in_bytes", str(limits.memory_mib << 20))
        if (memory / "memory.memsw.limit_in_bytes").exists():  # absent without swap accounting
            write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_mib << 20))
        cpu = self.roots["cpu"] / name
        write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        write(cpu / "cpu.cfs_quota_us", str(limits.cpu_quota_us()))
        write(self.roots["pids"] / name / "pids.max", str(limits.pids))

    def join(self, name: str, argv: list[str]) -> list[str]:
        return join_argv([group / "cgroup.procs" for group in self._groups(name)], argv)

    def usage(self, name: str) -> CgroupUsage:
        try:
            tasks = int((self.roots["pids"] / name / "pids.current").read_text())
            cpu_ns = int((self.roots["cpuacct"] / name / "cpuacct.usage").read_text())
            memory = int((self.roots["memory"] / name / "memory.usage_in_bytes").read_text())
        except OSError:  # removed as the worker ended
            return CgroupUsage(0, 0.0, 0.0)
        return CgroupUsage(tasks, cpu_ns / 1e9, memory / (1 << 20), self.out_of_memory(name))

    def out_of_memory(self, name: str) -> bool:
        """Whether the kernel killed one of the worker's processes for its memory limit."""
        control = dict(line.split() for line in lines(self.roots["memory"] / name / "memory.oom_control"))
        return int(control.get("oom_kill", 0)) > 0

    def remove(self, name: str) -> None:
        for group in self._groups(name):
            with contextlib.suppress(OSError):  # still busy: removed with the tree when the host closes
                group.rmdir()

    def close(self) -> None:
        for root in dict.fromkeys(self.roots.values()):
            remove_tree(root)


def detect(proc: Path) -> tuple[CgroupV1Tree | None, str]:
    """Each controller's v1 hierarchy, this process's group in it, and a ``pie-workers-<pid>-<n>``
    group made there."""
    own = {}  # controller -> this process's group path in its hierarchy
    for line in lines(proc / "cgroup"):
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    groups = {}
    for fields in mounts(proc):
        dash = fields.index("-")
        if fields[dash + 1] != "cgroup":
            continue
        for controller in set(fields[dash + 3].split(",")) & set(CONTROLLERS):
            root, mount_point = fields[3], Path(fields[4])
            path = own.get(controller, "")
            if path == root or path.startswith(root.rstrip("/") + "/"):
                groups[controller] = mount_point / path[len(root) :].lstrip("/")
    missing = sorted(set(CONTROLLERS) - set(groups))
    if missing:
        return None, f"no cgroup v1 hierarchy of this process has the {'/'.join(missing)} controller"
    roots, name = {}, tree_name()
    for controller, group in groups.items():
        root = group / name
        try:
            if root not in roots.values():
                remove_stale(group)
                root.mkdir(exist_ok=True)
        except OSError as e:
            for made in dict.fromkeys(roots.values()):
                remove_tree(made)
            return None, f"cgroup v1 group {group} may not be written ({e.strerror})"
        roots[controller] = root
    return CgroupV1Tree(roots), f"cgroup v1 under {roots['memory']}"
