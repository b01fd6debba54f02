"""What both cgroup layouts share (v2 in ``cgroups.py``, v1 in ``cgroups_v1.py``): the limits and usage of one
worker's cgroup, and reading and writing the kernel's cgroup files."""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "pie-workers-"  # the trees a host makes: pie-workers-<its pid>-<n>, one per pool it starts
_trees = itertools.count()
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupLimits:
    """What the kernel lets one worker use, all its processes together."""

    memory_mib: int
    cpus: float
    pids: int

    def cpu_quota_us(self) -> int:
        """CPU time per ``CPU_PERIOD_US`` its processes together may use."""
        return max(1000, int(self.cpus * CPU_PERIOD_US))


@dataclass(frozen=True)
class CgroupUsage:
    tasks: int
    cpu_s: float
    memory_mib: float
    out_of_memory: bool = False  # the kernel killed one of its processes for the worker's memory limit


def join_argv(procs_files: list[Path], argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first moves itself into the worker's cgroups (one ``cgroup.procs`` per
    hierarchy; its children are born there): no hook runs between fork and exec in the host's many-threaded
    process."""
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 1; shift; n=$((n - 1)); done; exec "$@"'
    return ["/bin/sh", "-c", script, "join", str(len(procs_files)), *map(str, procs_files), *argv]


def tree_name() -> str:
    """A name for a new tree of this process's: a pool started after another in one process (a restarted host's,
    the tests') never meets the groups its predecessor could not yet remove (processes still exiting)."""
    return f"{PREFIX}{os.getpid()}-{next(_trees)}"


def mounts(proc: Path) -> list[list[str]]:
    """``/proc/<pid>/mountinfo``, split: field 3 is the mount's root in its hierarchy, 4 its mount point; after
    the ``-`` separator come the file system type, its source and its super options (a v1 hierarchy's
    controllers)."""
    return [line.split() for line in lines(proc / "mountinfo")]


def lines(path: Path) -> list[str]:
    return read(path).splitlines()


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def remove_stale(base: Path) -> None:
    """The trees of hosts that died without removing theirs."""
    for old in base.glob(f"{PREFIX}*"):
        pid = old.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            remove_tree(old)


def remove_tree(root: Path) -> None:
    with contextlib.suppress(OSError):
        for child in root.iterdir():
            if child.is_dir():
                remove_tree(child)
        root.rmdir()
