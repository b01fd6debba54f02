"""The system-call filter of every worker: what an inferlet never needs is refused with EPERM.

Built with libseccomp (through ``pyseccomp``, a ctypes binding to the system's ``libseccomp.so.2``), the library
systemd, Docker and Flatpak build their filters with, and handed to bubblewrap's own ``--seccomp FD``, which loads
it right before the worker's interpreter starts. Refused: debugging and reading other processes (ptrace,
process_vm_*), kernel programs and performance counters (bpf, perf_event_open), the kernel keyrings, anything that
mounts or makes or enters namespaces (what bubblewrap did before the filter was loaded is not undone), userfaultfd
(a tool of kernel exploits), io_uring (its operations bypass this filter), modules, kexec, reboot, swap, accounting
and quotas. ``clone3`` answers ENOSYS (its flags are behind a pointer a filter cannot read), so libc falls back to
``clone``, whose flags are checked: no new namespaces. System calls of another architecture (32-bit calls on x86-64)
kill the process, libseccomp's default.
"""

from __future__ import annotations

import errno
import functools
import os

from pie_cluster.hosts.sandbox import SandboxUnavailable

REFUSED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "bpf", "perf_event_open",
    "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "chroot", "unshare", "setns",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "open_by_handle_at",
)  # fmt: skip
NEW_NAMESPACES = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}  # clone's flags (its first argument on every architecture but s390, which bubblewrap's users do not run)


def _library():
    """pyseccomp, or SandboxUnavailable naming the fix: the sandbox never runs without its filter."""
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as e:
        raise SandboxUnavailable(
            f"the inferlet sandbox's system-call filter needs libseccomp, which cannot be loaded ({e}). Install it "
            "(Debian/Ubuntu: apt-get install libseccomp2; Fedora/RHEL: dnf install libseccomp) and the pyseccomp "
            'package, or, if every user of this cluster is trusted, set [sandbox] mode = "off" in config.toml'
        ) from None
    return pyseccomp


@functools.cache
def worker_filter() -> bytes:
    """The filter as the kernel's BPF program, built once per process."""
    sc = _library()
    refuse = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in REFUSED:
        rules.add_rule(refuse, _number(sc, name))
    rules.add_rule(sc.ERRNO(errno.ENOSYS), _number(sc, "clone3"))
    for flag in NEW_NAMESPACES.values():
        rules.add_rule(refuse, _number(sc, "clone"), sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with open(os.memfd_create("pie-seccomp"), "w+b") as out:  # memory, not a file: a host may have no writable /tmp
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def _number(sc, name: str) -> int:
    number = sc.resolve_syscall(sc.Arch.NATIVE, name)
    if number == -1:  # __NR_SCMP_ERROR: a libseccomp older than the kernel interfaces named here
        raise SandboxUnavailable(f"this libseccomp does not know the system call {name}; upgrade it to 2.5 or later")
    return number


def pipe_with_filter() -> int:
    """A pipe's read end holding the filter, for ``bwrap --seccomp FD`` (the caller closes it once bwrap started)."""
    program = worker_filter()
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: far below a pipe's buffer, never blocks
    finally:
        os.close(write)
    return read
