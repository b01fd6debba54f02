"""One cgroup per worker, where this host may make cgroups: the kernel bounds the worker as a whole.

``detect`` takes cgroup v2 where the unified hierarchy has the memory, cpu and pids controllers, else cgroup v1
where each of them (and cpuacct) sits in a v1 hierarchy this host may write (``cgroups_v1.py``), else none.

On v2: ``memory.max`` (with ``memory.oom.group``: past it the kernel ends the whole worker, not one of its processes
at random; no swap), ``cpu.max`` (how many CPUs its processes together may keep busy) and ``pids.max`` (its
processes and threads together). The host's tree is ``pie-workers-<host pid>-<n>``, made under its own cgroup, or
beside it when its own holds processes (the kernel lets only a cgroup without processes hand controllers to its
children). A worker joins its cgroup before bubblewrap starts (``join``), so nothing it ever runs is outside it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from pie_cluster.hosts.sandbox import cgroups_v1
from pie_cluster.hosts.sandbox.cgroup_common import (
    CPU_PERIOD_US,
    CgroupLimits,
    CgroupUsage,
    join_argv,
    lines,
    mounts,
    read,
    remove_stale,
    remove_tree,
    tree_name,
    write,
)

CONTROLLERS = ("cpu", "memory", "pids")


@dataclass(frozen=True)
class CgroupTree:
    """cgroup v2. ``root``: the cgroup this host made, each worker's cgroup a child of it."""

    root: Path
    version = "v2"

    def make(self, name: str, limits: CgroupLimits) -> None:
        group = self.root / name
        group.mkdir()
        write(group / "memory.max", str(limits.memory_mib << 20))
        write(group / "memory.oom.group", "1")
        if (group / "memory.swap.max").exists():  # absent where the kernel has no swap accounting
            write(group / "memory.swap.max", "0")
        write(group / "cpu.max", f"{limits.cpu_quota_us()} {CPU_PERIOD_US}")
        write(group / "pids.max", str(limits.pids))

    def join(self, name: str, argv: list[str]) -> list[str]:
        return join_argv([self.root / name / "cgroup.procs"], argv)

    def usage(self, name: str) -> CgroupUsage:
        group = self.root / name
        try:
            cpu = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            tasks = int((group / "pids.current").read_text())
            memory = int((group / "memory.current").read_text())
        except OSError:  # removed as the worker ended
            return CgroupUsage(0, 0.0, 0.0)
        return CgroupUsage(tasks, int(cpu["usage_usec"]) / 1e6, memory / (1 << 20))

    def out_of_memory(self, name: str) -> bool:
        """Whether the kernel ended the worker for going past its ``memory.max``."""
        try:
            events = dict(line.split() for line in (self.root / name / "memory.events").read_text().splitlines())
        except OSError:
            return False
        return int(events.get("oom_group_kill", 0)) + int(events.get("oom_kill", 0)) > 0

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):  # still busy: removed with the tree when the host closes
            (self.root / name).rmdir()

    def close(self) -> None:
        remove_tree(self.root)


def detect(proc: Path = Path("/proc/self")) -> tuple[CgroupTree | cgroups_v1.CgroupV1Tree | None, str]:
    """This host's cgroup tree for workers, or None and why there is none."""
    tree, why_not_v2 = _detect_v2(proc)
    if tree is not None:
        return tree, why_not_v2
    tree_v1, why_not_v1 = cgroups_v1.detect(proc)
    if tree_v1 is not None:
        return tree_v1, why_not_v1
    return None, f"{why_not_v2}; {why_not_v1}"


def _detect_v2(proc: Path) -> tuple[CgroupTree | None, str]:
    mount = next((Path(f[4]) for f in mounts(proc) if f[f.index("-") + 1] == "cgroup2"), None)
    own = next((line[3:] for line in lines(proc / "cgroup") if line.startswith("0::")), None)
    if mount is None or own is None:
        return None, "no cgroup v2 hierarchy is mounted"
    own_group = mount / own.lstrip("/")
    offered = set(read(own_group / "cgroup.controllers").split())
    if not offered.issuperset(CONTROLLERS):
        return None, f"cgroup v2 at {mount} offers no {'/'.join(sorted(set(CONTROLLERS) - offered))} controller here"
    why = "no cgroup v2 group near this process's own may be written"
    name = tree_name()
    for base in [own_group] if own_group == mount else [own_group, own_group.parent]:
        remove_stale(base)
        try:
            if not set(read(base / "cgroup.subtree_control").split()).issuperset(CONTROLLERS):
                write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
            root = base / name
            root.mkdir(exist_ok=True)
            write(root / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
        except OSError as e:
            why = f"{base} cannot hand its controllers to a cgroup of the workers ({e.strerror})"
            continue
        return CgroupTree(root), f"cgroup v2 under {root}"
    return None, why
