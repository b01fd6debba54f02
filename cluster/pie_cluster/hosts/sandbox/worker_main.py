"""The sandboxed worker process: runs one user's inferlet instances as asyncio tasks, as the host tells it.

Started by the host under bubblewrap (``bwrap.py``) with a scrubbed environment and one inherited socket (its fd in
``PIE_WORKER_FD``). It first lowers its own kernel limits, for good (it cannot raise them again), and only then runs
user code. It holds no Ray connection, no secret and no other user's data: what it knows is the instances it was
given, each with a capability that names that instance alone.

    python -m pie_cluster.hosts.sandbox.worker_main     (inside the sandbox; never by hand)
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import resource
import socket
from pathlib import Path

import inferlet.runtime

from pie_cluster.config import EVENT_BYTES_CEILING
from pie_cluster.hosts import stdio
from pie_cluster.hosts.event_limits import STREAMS, TERMINAL, check_event, cut, size_of
from pie_cluster.hosts.run import serve_instance
from pie_cluster.hosts.sandbox import watchdog
from pie_cluster.hosts.sandbox.bwrap import PROGRAMS
from pie_cluster.hosts.sandbox.protocol import (
    AbortMessage,
    EventMessage,
    FrameWriter,
    InstanceSpec,
    PingMessage,
    PongMessage,
    ProgramRef,
    ReceiveMessage,
    ReplyMessage,
    StartMessage,
    WaitingMessage,
    host_message,
    read_frames,
)
from pie_cluster.programs.program import Program

OUTPUT_BACKLOG_BYTES = 4 << 20  # unread by the host, past which the worker drops its instances' output


def confine(uid: int | None, limits: dict[str, int]) -> None:
    """Take the worker's own uid (dropping the last capabilities with it) and its kernel limits, soft and hard at
    once: without CAP_SYS_RESOURCE it can never raise them back. Nor may it raise its CPU priority above the one it
    was started with (``[sandbox] nice``), below the trusted side's."""
    _, hard = resource.getrlimit(resource.RLIMIT_NICE)
    floor = min(hard, 20 - os.getpriority(os.PRIO_PROCESS, 0))  # the lowest nice value allowed, as 20 - nice
    resource.setrlimit(resource.RLIMIT_NICE, (floor, floor))
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


class _Session:
    """``inferlet.session`` of one instance: events out, the client's messages and files in, all via the host."""

    def __init__(self, worker: Worker, instance_id: str):
        self._worker, self._id = worker, instance_id

    def send(self, text: str) -> None:
        self._worker.event(self._id, "message", text)

    def send_file(self, data: bytes) -> None:
        self._worker.event(self._id, "file", bytes(data))

    async def receive(self) -> str:
        return await self._worker.ask(self._id, "message")

    async def receive_file(self) -> bytes:
        return await self._worker.ask(self._id, "file")


class Worker:
    def __init__(self, out: FrameWriter, memory_mib: int):
        self.out = out
        self.memory_mib = memory_mib
        self._tasks: dict[str, asyncio.Task] = {}
        self._abort_reasons: dict[str, str] = {}
        self._waiting: dict[int, asyncio.Future] = {}
        self._rids = itertools.count()
        self._programs: dict[str, Program] = {}
        self._dropped: dict[str, int] = {}  # instance -> characters of output dropped since it last went out

    def handle(self, message: list) -> None:
        match host_message(message):
            case StartMessage(spec):
                task = asyncio.get_running_loop().create_task(self._run(spec))
                self._tasks[spec.setup.instance_id] = task
            case AbortMessage(instance_id, reason):
                task = self._tasks.get(instance_id)
                if task is not None and not task.done():
                    self._abort_reasons[instance_id] = reason
                    task.cancel()
            case ReplyMessage(rid, error, value):
                waiter = self._waiting.pop(rid, None)
                if waiter is None or waiter.done():
                    return
                if error:
                    waiter.set_exception(RuntimeError(error))
                else:
                    waiter.set_result(value)
            case PingMessage(seq):
                self.out.send(PongMessage(seq))

    def event(self, instance_id: str, kind: str, value) -> None:
        """An instance's event to the host, as the protocol carries it: a stream's writes of one turn merged, and
        no value larger than any event may be (the host enforces the smaller ``[limits]``): a message or file that
        is raises here, in the program; a return value or error that is becomes an error that says so."""
        check_event(kind, value)
        if kind in STREAMS:
            self._output(instance_id, kind, value)
            return
        if (size := size_of(value)) > EVENT_BYTES_CEILING:
            over = f"{size} bytes, over the most any event may have ({EVENT_BYTES_CEILING})"
            if kind not in TERMINAL:
                raise ValueError(f"this {kind} has {over}")
            value = cut(value, EVENT_BYTES_CEILING) if kind == "error" else f"its return value has {over}"
            kind = "error"
        self.out.send(EventMessage(instance_id, kind, value))

    def _output(self, instance_id: str, kind: str, text: str) -> None:
        """Stdout or stderr to the host, dropped (and counted, for a line saying so) while the host has not yet
        read ``OUTPUT_BACKLOG_BYTES`` written before: the worker's memory and its answers to pings wait on no flood."""
        if self.out.backlog() > OUTPUT_BACKLOG_BYTES:
            self._dropped[instance_id] = self._dropped.get(instance_id, 0) + len(text)
            return
        if dropped := self._dropped.pop(instance_id, 0):
            text = f"[pie: {dropped} characters of output dropped: written faster than the host reads]\n{text}"
        self.out.send_text(instance_id, kind, text)

    async def ask(self, instance_id: str, kind: str):
        rid = next(self._rids)
        waiter = self._waiting[rid] = asyncio.get_running_loop().create_future()
        self.out.send(ReceiveMessage(instance_id, kind, rid))
        try:
            return await waiter
        finally:
            self._waiting.pop(rid, None)

    def _program(self, ref: ProgramRef, root: Path) -> Program:
        """The program under ``root``, read once per worker (the host writes each program's files once, too)."""
        if ref.id not in self._programs:
            files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
            self._programs[ref.id] = Program(ref.id, ref.name, ref.version, ref.entry, files)
        return self._programs[ref.id]

    async def _run(self, spec: InstanceSpec) -> None:
        instance_id = spec.setup.instance_id

        def emit(kind: str, value) -> None:
            if kind == "error" and value.startswith("MemoryError"):
                value += f" (this user's worker may use {self.memory_mib} MiB)"
            self.event(instance_id, kind, value)

        root = Path(PROGRAMS) / spec.program.id
        try:
            program = self._program(spec.program, root)
            await serve_instance(
                program,
                lambda: program.load_main(root),
                spec.input,
                spec.setup,
                emit,
                _Session(self, instance_id),
                aborted=lambda: self._abort_reasons.pop(instance_id, "aborted"),
            )
        except Exception as e:  # the program's files are unreadable: still the instance's own error
            emit("error", f"{type(e).__name__}: {e}")
        finally:
            self._tasks.pop(instance_id, None)


async def _serve(fd: int, memory_mib: int, stall_s: float) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    worker = Worker(FrameWriter(writer), memory_mib)
    watchdog.install(asyncio.get_running_loop(), stall_s, lambda waiting: worker.out.send_now(WaitingMessage(waiting)))
    inferlet.runtime.blocking_wait = watchdog.waiting_on_the_cluster
    await read_frames(reader, worker.handle)  # the host closed the socket: the worker's life is over


def main() -> None:
    uid = os.environ.pop("PIE_WORKER_UID", "")
    limits = json.loads(os.environ.pop("PIE_WORKER_LIMITS"))
    confine(int(uid) if uid else None, limits)
    fd = int(os.environ.pop("PIE_WORKER_FD"))
    stdio.install_router()
    gc.freeze()  # the imports live as long as the worker: full collections need not scan them
    stall_s = float(os.environ.pop("PIE_WORKER_STALL_S"))
    asyncio.run(_serve(fd, limits["RLIMIT_AS"] >> 20, stall_s))
    os._exit(0)  # instances left running die with the process; their replicas see the connection close


if __name__ == "__main__":
    main()
