"""A worker's operating-system process, started and awaited without holding the host's event loop.

Ray runs async actors on uvloop, whose ``subprocess_exec`` forks the whole actor from the loop's thread and runs the
at-fork hooks of every library it loaded: 100-200 ms of an inferlet host's loop per worker started, which every
user's events wait behind. ``subprocess.Popen`` in a thread starts it with vfork instead and returns at once; the
loop learns of the exit from a pidfd it watches and reads the process's output from its pipe as a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess

from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox.watchdog import STALLED


class WorkerProcess:
    def __init__(self, popen: subprocess.Popen, exited: asyncio.Event, stdout: asyncio.StreamReader):
        self._popen, self._exited, self.stdout = popen, exited, stdout

    @classmethod
    async def start(cls, argv: list[str], pass_fds: tuple[int, ...], env: dict[str, str]) -> WorkerProcess:
        """``argv`` in a process group of its own (see ``kill``), stdout and stderr into one pipe."""
        popen = await asyncio.to_thread(
            subprocess.Popen,
            argv,
            pass_fds=pass_fds,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        loop = asyncio.get_running_loop()
        exited, pidfd = asyncio.Event(), os.pidfd_open(popen.pid)

        def reap() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            popen.wait()  # it has exited: this only collects its status
            exited.set()

        loop.add_reader(pidfd, reap)
        stdout = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), popen.stdout)
        return cls(popen, exited, stdout)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """None until the process has exited; bwrap's status otherwise (the worker's, or 128 + a signal)."""
        return self._popen.returncode if self._exited.is_set() else None

    async def wait(self) -> int:
        await self._exited.wait()
        return self._popen.returncode

    def kill(self) -> None:
        """Kill the worker's whole process group, not only bwrap: a bwrap killed while it starts leaves its
        namespace's first process behind (it sets its parent-death signal only later), holding the worker's socket
        and output. Past that point ``--die-with-parent`` and the PID namespace take every process in the sandbox."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)


def describe_exit(code: int, config: SandboxConfig) -> str:
    """bwrap exits with the worker's status, or 128 + the signal that killed it."""
    if code == STALLED:
        return (
            f"one of this user's inferlets held its event loop for more than {config.stall_s:g} s (a busy loop or "
            "a blocking call; await, or use asyncio.to_thread)"
        )
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if signum == signal.SIGKILL:
        return f"it was killed (out of memory; its limit is {config.memory_mib} MiB of address space)"
    if signum == signal.SIGXCPU:
        return f"it used up its CPU-time limit ({config.cpu_seconds} s)"
    if signum:
        return f"it died of signal {signal.Signals(signum).name}"
    return f"it exited with status {code}"
