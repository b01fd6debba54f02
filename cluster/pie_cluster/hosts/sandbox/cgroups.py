"""One cgroup v2 per worker, where this host may make cgroups: the kernel bounds the worker as a whole.

``memory.max`` (with ``memory.oom.group``: past it the kernel ends the whole worker, not one of its processes at
random; no swap), ``cpu.max`` (how many CPUs its processes together may keep busy) and ``pids.max`` (its processes
and threads together). A host may make cgroups when the unified hierarchy is mounted with the memory, cpu and pids
controllers (not on cgroup v1 or hybrid hosts, whose controllers sit in v1 hierarchies) and it can write a subtree:
``pie-workers-<host pid>`` made under its own cgroup, or beside it when its own holds processes (the kernel lets
only a cgroup without processes hand controllers to its children). A worker joins its cgroup before bubblewrap
starts (``join``), so nothing it ever runs is outside it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("cpu", "memory", "pids")
CPU_PERIOD_US = 100_000
PREFIX = "pie-workers-"


@dataclass(frozen=True)
class CgroupLimits:
    """What the kernel lets one worker use, all its processes together."""

    memory_mib: int
    cpus: float
    pids: int


@dataclass(frozen=True)
class CgroupUsage:
    tasks: int
    cpu_s: float
    memory_mib: float


@dataclass(frozen=True)
class CgroupTree:
    """``root``: the cgroup this host made, each worker's cgroup a child of it."""

    root: Path

    def make(self, name: str, limits: CgroupLimits) -> Path:
        group = self.root / name
        group.mkdir()
        _write(group / "memory.max", str(limits.memory_mib << 20))
        _write(group / "memory.oom.group", "1")
        if (group / "memory.swap.max").exists():  # absent where the kernel has no swap accounting
            _write(group / "memory.swap.max", "0")
        _write(group / "cpu.max", f"{max(1000, int(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
        _write(group / "pids.max", str(limits.pids))
        return group

    def join(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into the worker's cgroup (its children are born there);
        no hook runs between fork and exec in the host's many-threaded process."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.root / name / "cgroup.procs"), *argv]

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
        _remove_tree(self.root)


def detect(proc: Path = Path("/proc/self")) -> tuple[CgroupTree | None, str]:
    """This host's cgroup tree for workers, or None and why there is none."""
    mount = next((Path(f[4]) for f in _mounts(proc) if f[f.index("-") + 1] == "cgroup2"), None)
    own = next((line[3:] for line in _lines(proc / "cgroup") if line.startswith("0::")), None)
    if mount is None or own is None:
        return None, "no cgroup v2 hierarchy is mounted"
    own_group = mount / own.lstrip("/")
    offered = set(_read(own_group / "cgroup.controllers").split())
    if not offered.issuperset(CONTROLLERS):
        return None, f"cgroup v2 at {mount} offers no {'/'.join(sorted(set(CONTROLLERS) - offered))} controller here"
    why = "no cgroup near this process's own may be written"
    for base in [own_group] if own_group == mount else [own_group, own_group.parent]:
        _remove_stale(base)
        try:
            if not set(_read(base / "cgroup.subtree_control").split()).issuperset(CONTROLLERS):
                _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
            root = base / f"{PREFIX}{os.getpid()}"
            root.mkdir(exist_ok=True)
            _write(root / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
        except OSError as e:
            why = f"{base} cannot hand its controllers to a cgroup of the workers ({e.strerror})"
            continue
        return CgroupTree(root), f"cgroup v2 under {root}"
    return None, why


def _mounts(proc: Path) -> list[list[str]]:
    return [line.split() for line in _lines(proc / "mountinfo")]


def _lines(path: Path) -> list[str]:
    return _read(path).splitlines()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _remove_stale(base: Path) -> None:
    """The trees of hosts that died without removing theirs."""
    for old in base.glob(f"{PREFIX}*"):
        pid = old.name.removeprefix(PREFIX)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove_tree(old)


def _remove_tree(root: Path) -> None:
    with contextlib.suppress(OSError):
        for child in root.iterdir():
            if child.is_dir():
                _remove_tree(child)
        root.rmdir()
