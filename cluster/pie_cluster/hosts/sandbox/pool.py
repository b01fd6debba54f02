"""Each user's sandboxed workers on one node: started, reused, watched and ended by the trusted host.

A user's instances share that user's worker (one interpreter for hundreds of inferlets, so a launch costs a message, not
a process); an ``isolated`` program gets a worker of its own, ended with its instance, which counts against the user's
``max_workers_per_user`` on this node like all theirs (past it a launch waits for one to end). One spare worker is kept
started, bound to a user on first use: even a user's first launch waits for no process. One is ended when it stalls (one
task step holds its event loop for ``stall_s``: its own watchdog exits; or it answers no ping for six times that; time
it waited for a CPU counts for neither: ``cpu_wait.py``), dies (a crash, a kernel limit), reaches its limit of processes
or of memory as a whole (``limits.py``), sends what is not the protocol, keeps an instance past its deadline, or sits
idle for ``idle_s``; its instances end with an error event that says why, and the next launch starts a fresh one.
Workers are retired (they take no new instances and end with their last) when the services change (a replica replaced:
new sockets to bind in) and past half their CPU-time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.description import PoolStats
from pie_cluster.hosts.sandbox import bwrap, cpu_wait, seccomp
from pie_cluster.hosts.sandbox.limits import WorkerLimits
from pie_cluster.hosts.sandbox.process import WorkerProcess, describe_exit
from pie_cluster.hosts.sandbox.protocol import (
    MAX_WORKER_MESSAGE_BYTES,
    WORKER_READ_RATE,
    AbortMessage,
    EventMessage,
    FrameWriter,
    InstanceSpec,
    PingMessage,
    PongMessage,
    ProtocolError,
    ReplyMessage,
    StartMessage,
    WaitingMessage,
    read_frames,
    worker_message,
)
from pie_cluster.hosts.sandbox.view import SandboxView
from pie_cluster.programs.program import Program

_TAIL_BYTES = 4096  # of a worker's own stdout/stderr, kept to explain its death
UNANSWERED_STALLS = 6  # the host's backstop: a worker silent this many times ``stall_s`` is ended (see watchdog.py)
EXIT_GRACE_S = 2.0  # how long a worker whose socket closed has to exit before it is killed
MAX_RECEIVING = 4096  # receives of one worker's instances waiting at once (each holds a task on the host)
START_TRIES = 3  # workers an instance's start is tried on, when each ends before the instance is handed to it
DEADLINE_GRACE_S = 5.0  # past an instance's deadline, how long its worker has to end it before the host ends both


@dataclass(frozen=True)
class HostSide:
    """What the pool calls back into the host for: events out, the client's messages in, an instance's end."""

    emit: Callable[[str, str, str | bytes], None]  # (instance, kind, value)
    receive: Callable[[str, str], Awaitable]  # (instance, "message" | "file") -> what its client sent
    ended: Callable[[str], None]  # the instance's terminal event has been emitted


@dataclass
class Worker:
    """One sandboxed process and the instances it runs."""

    slot: int
    directory: Path
    process: WorkerProcess
    out: FrameWriter
    user: str | None = None  # None: the spare, not yet anyone's
    dedicated: bool = False
    instances: set[str] = field(default_factory=set)
    programs: dict[str, asyncio.Future] = field(default_factory=dict)  # program id -> its write into /pie/programs
    idle_since: float = field(default_factory=time.monotonic)
    retired: bool = False  # takes no new instances; ends when its last one does
    death: str | None = None  # why the host ended it, when it did
    tail: bytearray = field(default_factory=bytearray)
    pongs: int = 0
    waiting: bool = False  # blocked on the cluster (it says): no ping deadline until it is not
    receives: set[asyncio.Task] = field(default_factory=set)  # its instances' receives the host is answering


class WorkerPool:
    def __init__(self, config: SandboxConfig, directory: Path, host: HostSide):
        self._config = config
        self._directory = directory
        self._host = host
        self._slots = itertools.count()
        self._workers: dict[str, list[Worker]] = {}  # user -> their workers (the first one not retired takes launches)
        self._by_instance: dict[str, Worker] = {}
        self._spare: asyncio.Task | None = None
        self._view: SandboxView | None = None
        self._tasks: set[asyncio.Task] = set()
        self._limits = WorkerLimits(config)
        self._freed = asyncio.Condition()  # notified when a user's workers change: a launch past the bound waits
        self._taking: dict[str, int] = {}  # user -> workers being started for them, counted against their bound

    def set_view(self, view: SandboxView) -> None:
        """New services: workers started from now on bind these; running ones finish what they have."""
        self._view = view
        for workers in self._workers.values():
            for worker in workers:
                self._retire(worker)
        if self._spare is not None:  # started with the old sockets: end it once it is up
            self._spawn_task(self._discard(self._spare))
            self._spare = None

    # -- launching -------------------------------------------------------------------------------------------

    async def start(self, user: str, program: Program, spec: InstanceSpec, isolated: bool) -> None:
        for _ in range(START_TRIES):
            worker = await self._worker_for(user, isolated)
            await self._written(worker, program)
            if not worker.retired:  # (it may have ended while the program was written: its instances were told)
                break
        else:
            raise RuntimeError(f"{START_TRIES} of this user's workers in a row ended while it was being started")
        instance_id, deadline_s = spec.setup.instance_id, spec.setup.limits.deadline_s
        worker.instances.add(instance_id)
        self._by_instance[instance_id] = worker
        worker.out.send(StartMessage(spec))
        if deadline_s is not None:  # the worker enforces it; this is for a program that swallows the cancel
            loop = asyncio.get_running_loop()
            loop.call_later(deadline_s + DEADLINE_GRACE_S, self._overdue, worker, instance_id)

    async def _written(self, worker: Worker, program: Program) -> None:
        """The program's files are in the worker's /pie/programs: written once, and every launch that comes while
        they are being written waits for that write (a second write would truncate them under a reading worker)."""
        writing = worker.programs.get(program.id)
        if writing is None:
            target = worker.directory / "programs" / program.id
            writing = worker.programs[program.id] = asyncio.ensure_future(asyncio.to_thread(program.write_out, target))
        try:
            await asyncio.shield(writing)
        except Exception:
            worker.programs.pop(program.id, None)  # the next launch tries again
            raise

    def abort(self, instance_id: str, reason: str) -> bool:
        worker = self._by_instance.get(instance_id)
        if worker is None:
            return False
        worker.out.send(AbortMessage(instance_id, reason))
        return True

    async def _worker_for(self, user: str, isolated: bool) -> Worker:
        """The user's shared worker, or a new one once the user holds fewer than ``max_workers_per_user`` (isolated
        programs' workers and retired ones count: they hold memory and processes too); until then the launch
        waits, and an abort or deadline ends the wait."""
        async with self._freed:
            while True:
                shared = [w for w in self._workers.get(user, ()) if not (w.retired or w.dedicated)]
                if shared and not isolated:
                    return shared[0]
                held = len(self._workers.get(user, ())) + self._taking.get(user, 0)
                if held < self._config.max_workers_per_user:
                    break
                await self._freed.wait()
            self._taking[user] = self._taking.get(user, 0) + 1
        try:
            worker = await self._take_spare()
            worker.user, worker.dedicated = user, isolated
            self._workers.setdefault(user, []).append(worker)
        finally:
            self._taking[user] -= 1
            if not self._taking[user]:
                del self._taking[user]
            await self._notify_freed()
        return worker

    async def _notify_freed(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    async def _take_spare(self) -> Worker:
        spare, self._spare = self._spare, None
        worker = await spare if spare is not None else await self._spawn()
        self._spare = asyncio.get_running_loop().create_task(self._spawn())  # the next one, while this one works
        return worker

    # -- one worker's life -----------------------------------------------------------------------------------

    async def _spawn(self) -> Worker:
        if self._view is None:
            raise RuntimeError("the sandbox has no services to give its workers yet")
        slot = next(self._slots)
        directory = self._directory / f"worker-{slot}"
        (directory / "programs").mkdir(parents=True, mode=0o755)
        mounts = bwrap.WorkerMounts(directory / "programs", self._view.models, self._view.sockets)
        ours, theirs = socket.socketpair()
        rules = seccomp.pipe_with_filter()
        env = {
            "PIE_WORKER_FD": str(theirs.fileno()),
            "PIE_WORKER_LIMITS": json.dumps(self._limits.rlimits()),
            "PIE_WORKER_STALL_S": str(self._config.stall_s),
        }
        if (uid := bwrap.worker_uid(slot)) is not None:
            env["PIE_WORKER_UID"] = str(uid)
        env |= {"RAYON_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # few threads
        argv = [sys.executable, "-m", "pie_cluster.hosts.sandbox.worker_main"]
        try:
            confined = bwrap.command(self._config, mounts, argv, {**env, "PYTHONDONTWRITEBYTECODE": "1"}, rules)
            process = await WorkerProcess.start(
                self._limits.confine(slot, confined),  # niced, and in its cgroup where there are cgroups
                pass_fds=(theirs.fileno(), rules),
                env={"PATH": "/usr/bin:/bin"},  # bwrap's own: its init process inside must not carry the host's
            )
        finally:
            theirs.close()
            os.close(rules)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        worker = Worker(slot, directory, process, FrameWriter(writer))
        self._spawn_task(self._serve(worker, reader))
        self._spawn_task(self._keep_tail(worker))
        self._spawn_task(self._watch(worker))
        return worker

    async def _serve(self, worker: Worker, reader: asyncio.StreamReader) -> None:
        """Read the worker's messages until it goes away; then end its instances, saying why. Whatever it sends,
        only this worker pays: what is not the protocol ends it (its instances end with an error saying what it
        sent), and so does a fault of the host's own in handling a message of its."""
        try:
            handle = functools.partial(self._handle, worker)
            await read_frames(reader, handle, MAX_WORKER_MESSAGE_BYTES, WORKER_READ_RATE)
        except ProtocolError as e:
            self._stop(worker, f"it broke the host protocol ({e})")
        except OSError:
            pass
        except Exception as e:
            self._stop(worker, f"the host failed on what it sent ({type(e).__name__}: {e})")
        await self._end(worker)

    def _handle(self, worker: Worker, message: list) -> None:
        """One message of the worker's, checked (``worker_message``) before anything is done with it."""
        checked = worker_message(message)
        if isinstance(checked, PongMessage):
            worker.pongs = checked.seq
            return
        if isinstance(checked, WaitingMessage):
            worker.waiting = checked.waiting
            return
        instance_id = checked.instance
        if instance_id not in worker.instances:  # not one of its own: a worker cannot speak for others
            raise ProtocolError(f"it named an instance it does not run ({instance_id!r:.40})")
        if isinstance(checked, EventMessage):
            self._host.emit(instance_id, checked.kind, checked.value)
            if checked.kind in ("return", "error"):
                self._instance_ended(worker, instance_id)
        elif len(worker.receives) >= MAX_RECEIVING:
            raise ProtocolError(f"it waits on more than {MAX_RECEIVING} receives at once")
        else:
            answer = self._spawn_task(self._answer(worker, instance_id, checked.kind, checked.rid))
            worker.receives.add(answer)
            answer.add_done_callback(worker.receives.discard)

    async def _answer(self, worker: Worker, instance_id: str, what: str, rid: int) -> None:
        try:
            worker.out.send(ReplyMessage(rid, None, await self._host.receive(instance_id, what)))
        except Exception as e:
            worker.out.send(ReplyMessage(rid, str(e) or type(e).__name__, None))

    def _overdue(self, worker: Worker, instance_id: str) -> None:
        if instance_id in worker.instances:
            self._stop(worker, f"instance {instance_id} ran past its deadline and ignored being cancelled")

    def _instance_ended(self, worker: Worker, instance_id: str) -> None:
        worker.instances.discard(instance_id)
        self._by_instance.pop(instance_id, None)
        self._host.ended(instance_id)
        if not worker.instances:
            worker.idle_since = time.monotonic()
            if worker.dedicated or worker.retired:
                self._stop(worker, None)

    async def _watch(self, worker: Worker) -> None:
        """Pings a busy worker and ends one that stays silent, but while it says it waits on the cluster (the
        worker's own watchdog ends it sooner when one task step holds its loop); counts its processes and CPU time;
        ends it once it has idled ``idle_s``."""
        stall_s = self._config.stall_s
        period, deadline_s = min(1.0, stall_s / 4), stall_s * UNANSWERED_STALLS
        bound_s = stall_s * cpu_wait.WALL_BOUND_STALLS  # however long it waited for a CPU
        seq, answered_at = 0, time.monotonic()
        woke, heard_at, waits = answered_at, answered_at, None  # heard_at: the last answer, in wall time
        while worker.process.returncode is None:
            await asyncio.sleep(period)
            now = time.monotonic()
            # time this loop itself did not run (a starved host) is not the worker's silence: its pong may be
            # waiting unread in the socket; nor is time the worker's loop waited for a CPU (cpu_wait.py)
            answered_at += max(0.0, now - woke - 2 * period)
            woke = now
            if not worker.instances:  # nothing to answer for, and no reading /proc for an idle worker
                answered_at, heard_at, waits = now, now, None
                if worker.user is not None and now - worker.idle_since > self._config.idle_s:
                    self._stop(worker, None)
                continue
            if waits is None and (python := cpu_wait.worker_process(worker.process.pid)) is not None:
                waits = cpu_wait.WaitClock(python)
            answered_at += waits.since_last_look() if waits is not None else 0.0
            if worker.pongs == seq or worker.waiting:  # (a worker could as well answer pings from a thread)
                answered_at = heard_at = now
            usage = await self._limits.usage(worker.slot, worker.process.pid, now)
            if usage.cpu_s >= self._config.cpu_seconds / 2:  # so the kernel's limit ends only a worker that its
                self._retire(worker)  # instances keep busy for the other half
            if (why := self._limits.exceeded(usage)) is not None:
                self._stop(worker, why)
                continue
            starving = waits is not None and waits.waiting  # its deadline waits for it to run and be counted
            if now - answered_at > deadline_s and not starving or now - heard_at > bound_s:
                self._stop(worker, f"it answered nothing for {now - heard_at:.0f} s (its deadline: {deadline_s:g} s)")
                continue
            if worker.pongs == seq:
                seq += 1
                worker.out.send(PingMessage(seq))

    async def _keep_tail(self, worker: Worker) -> None:
        while data := await worker.process.stdout.read(1 << 16):
            worker.tail += data
            del worker.tail[:-_TAIL_BYTES]

    def _stop(self, worker: Worker, reason: str | None) -> None:
        if reason is not None and worker.death is None:
            worker.death = reason
        self._retire(worker)
        worker.process.kill()

    def _retire(self, worker: Worker) -> None:
        worker.retired = True
        if not worker.instances and worker.process.returncode is None:
            worker.out.close()  # the worker exits when its socket closes

    async def _end(self, worker: Worker) -> None:
        worker.retired = True  # nothing more is started on it
        for answer in list(worker.receives):  # nobody is left to read what its instances' clients send
            answer.cancel()
        try:  # its socket closed: it is exiting (its status says why), or it closed the socket and lingers
            code = await asyncio.wait_for(worker.process.wait(), EXIT_GRACE_S)
        except TimeoutError:  # (killed here, it is not what a SIGKILL usually means: out of memory)
            worker.death = worker.death or f"its socket to the host closed; it did not exit within {EXIT_GRACE_S:g} s"
            worker.process.kill()
            code = await worker.process.wait()
        ended_by_limit = self._limits.released(worker.slot)
        if worker.instances:
            why = worker.death or ended_by_limit or describe_exit(code, self._config)
            tail = bytes(worker.tail).decode(errors="replace").strip().splitlines()[-3:]
            message = f"this user's sandboxed worker was ended: {why}" + (f" — {' | '.join(tail)}" if tail else "")
            for instance_id in sorted(worker.instances):
                self._host.emit(instance_id, "error", message)
                self._by_instance.pop(instance_id, None)
                self._host.ended(instance_id)
            worker.instances.clear()
        users = self._workers.get(worker.user, [])
        if worker in users:
            users.remove(worker)
            if not users:
                del self._workers[worker.user]
            await self._notify_freed()
        await asyncio.to_thread(shutil.rmtree, worker.directory, ignore_errors=True)

    def _spawn_task(self, work) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- reporting and shutdown ------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        workers = [w for ws in self._workers.values() for w in ws]
        return PoolStats(
            workers=len(workers),
            users=len(self._workers),
            instances=len(self._by_instance),
            spare=self._spare is not None,
            limits=self._limits.mode,
        )

    async def close(self) -> None:
        """End every worker, the spare too, and wait until they are gone."""
        spare, self._spare = self._spare, None
        if spare is not None:
            await self._discard(spare)
        for workers in list(self._workers.values()):
            for worker in list(workers):
                self._stop(worker, "the host is shutting down")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._limits.close()

    async def _discard(self, spare: asyncio.Task) -> None:
        with contextlib.suppress(Exception):
            self._stop(await spare, None)
