"""The launcher: one named actor that owns programs, admits and places instances, and learns how each one ended.

It is on no instance's per-event path: the host that runs an instance keeps its event stream and inbox
(``pie_cluster.hosts.events``); a client asks ``locate`` once and reads from there, and the host tells the launcher the
instance's ending. Its calls per instance are constant in the number of events (counted in ``stats``).

Clients (the HTTP app, ``pie submit`` through Ray Jobs) call it with the authenticated user's name; every
program belongs to the users who uploaded it and every instance to the user who launched it, and another user's
program or instance is reported as not existing (the same answer as a wrong id, so ids cannot be probed). Instances
run on inferlet hosts (``hosts.node_host``): the pooled host of a node that serves the models (least busy first) or of
the node asked for, or — only when the sandbox is off — a dedicated host for programs that want isolation.
Finished instances stay listed (and attachable) until ``keep_finished`` newer ones have ended. Ray restarts it when
its process dies, and it learns again what it had (``launcher.recovery``).

This is the actor's API; beside it: the instances' book (``launcher.instances``), the hosts it places on and
watches (``launcher.hosts``), admission (``launcher.admission``, ``launcher.leases``), its restart (``.recovery``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections import Counter
from pathlib import Path

import ray
import ray.exceptions
from pie_workers.deadlines import DEDICATED_START_S, HOST_S, MARKET_S, NoAnswer, answer
from pydantic import ValidationError

from pie_cluster.config import LauncherConfig, SupervisionConfig
from pie_cluster.hosts.events import TERMINAL, Ending, Location, NotFound
from pie_cluster.hosts.node_host import NodeServices
from pie_cluster.instance import InstanceLimits, Launch
from pie_cluster.launch_request import LaunchRequest, describe_errors
from pie_cluster.launcher.admission import Admission
from pie_cluster.launcher.hosts import Hosts, HostsWiring
from pie_cluster.launcher.instances import Instances
from pie_cluster.launcher.leases import Leases
from pie_cluster.launcher.records import (
    HostPool,
    InstanceRecord,
    LauncherStats,
    ListedInstance,
    RunnerOrders,
    RunnerReport,
    RunnerServices,
    RunOnHost,
    SlotAnswer,
    SlotAsk,
    Uploaded,
)
from pie_cluster.launcher.recovery import LauncherMemory, LauncherState, SavedLaunch, known_to_hosts, program_of
from pie_cluster.limits import ChannelLimits
from pie_cluster.market import endowment_for
from pie_cluster.overloaded import Overloaded
from pie_cluster.programs import BUILTINS
from pie_cluster.programs.program import Program
from pie_cluster.programs.store import ProgramStore, new_store_directory

DEDICATED_GRACE_S = 60.0
"""How long a dedicated host outlives its instance's end, so that its client can read what it has not read yet."""


class Launcher:
    def __init__(
        self, config: LauncherConfig, sandboxed: bool, supervision: SupervisionConfig, channels: ChannelLimits
    ):
        """``sandboxed``: uploaded programs run in the nodes' sandboxed workers (``[sandbox]`` is not off), so a
        manifest may not ask for a Ray runtime_env and an isolated program gets a worker, not a Ray actor, of its
        own; ``supervision``: how pooled hosts are pinged (a hung one is killed for Ray to restart); ``channels``:
        what an instance may put through its channel (``[limits]``), on a host of its own too."""
        self._memory = LauncherMemory()
        saved = self._memory.load()
        store = Path(saved.store) if saved else new_store_directory(config.program_store_dir)
        self._state = saved or LauncherState(str(store))
        self._sandboxed = sandboxed
        capacity = config.program_store_mib << 20
        self._programs = ProgramStore(
            store, capacity, stored=self._memory.holds, restore=saved is not None, blobs=self._memory.programs
        )
        self._builtins = {name: Program.from_path(path) for name, path in BUILTINS.items()}
        self._builtins_by_id = {program.id: program for program in self._builtins.values()}
        self._admission = Admission(config.admission_limits())
        self._leases = Leases(  # the ingress replicas and the slots they hold
            self._admission, supervision, lambda key: self._start(self._instances[key]), self._runner_died
        )
        wiring = HostsWiring(self._spawn, self._leases.services_changed, self._host_died)
        self._hosts = Hosts(self._state, self._memory, supervision, wiring)
        self._instances = Instances(config.keep_finished)
        self._dedicated_channels = dataclasses.replace(channels, keep_finished=1)
        self._default_deadline_s = config.default_deadline_s
        self._watching: set[asyncio.Task] = set()
        self.launched = 0
        self.calls: Counter[str] = Counter()  # calls taken from clients and hosts, by method
        self._memory.save(self._state)
        if saved is not None and saved.pool is not None:  # Ray restarted it: learn again what runs (see module)
            self._spawn(self._recover(saved.pool))

    async def _recover(self, pool: HostPool) -> None:
        for record in await known_to_hosts(pool, self._programs, self._builtins_by_id):
            self._instances.add(record)
            if record.ending is None:
                self._admission.resume(record.user)
                self._programs.started(record.user, record.program.id)
        waiting = sorted(self._memory.waiting.load().values(), key=lambda saved: saved.launch.created)
        for saved in waiting:
            self._queue_again(saved)
        self._hosts.watch_all()

    def _queue_again(self, saved: SavedLaunch) -> None:
        """A launch that waited for a slot when the old process died waits again (or starts, if one is free)."""
        launch = saved.launch
        program = program_of(launch.program, launch.user, self._programs, self._builtins_by_id)
        if program is None:  # deleted meanwhile: nothing to run
            self._memory.waiting.delete((launch.id,))
            return
        pool = self._hosts.pool
        node = saved.node_id if saved.node_id in pool.hosts else self._choose_node(None)
        instance = self._instances.add(saved.record(program, node, pool.hosts[node]))
        self._programs.started(instance.user, program.id)
        try:
            if self._admission.admit(instance.user, instance.id):
                self._start(instance)
        except Overloaded as e:
            self._finish(instance, "error", f"lost its place in the queue when the launcher restarted: {e}")

    # -- the hosts' side (launcher/hosts.py) ----------------------------------------------------------------------

    async def attach_pool(self, pool: HostPool) -> None:
        self._hosts.attach(pool)

    async def add_host(self, node: str, host, services: dict[str, NodeServices]) -> None:
        """A node joined: its pooled host takes launches from now on, watched like the others (``services``: every
        node's, the new one's included)."""
        self._hosts.add(node, host, services)

    async def set_services(self, services: dict[str, NodeServices]) -> None:
        """Replicas were replaced: what each node's instances reach from now on (dedicated hosts made later, and
        pooled hosts that Ray restarts, get these)."""
        self._hosts.set_services(services)

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _host_died(self, node: str, host) -> None:
        """A pooled host died or hung: its instances end with an error event and their wallets close."""
        lost = self._instances.running(lambda i: i.host is host and not i.queued)
        await self._lose(lost, f"the inferlet host on node {node} died; the instance was lost with it")

    async def _lose(self, lost: list[InstanceRecord], message: str) -> None:
        """Instances whose host died: their wallets close and they end with ``message``."""
        market = self._hosts.market
        if market is not None:
            with contextlib.suppress(ray.exceptions.RayError, NoAnswer):
                await answer(market.leave_many.remote([i.id for i in lost]), "the market", MARKET_S)
        for instance in lost:
            self._finish(instance, "error", message)

    # -- programs ------------------------------------------------------------------------------------------------

    async def upload(self, user: str, filename: str, data: bytes) -> Uploaded:
        """Store a program for ``user`` (a .py file or a .zip with pie.toml); returns its id and name@version."""
        program = Program.from_upload(filename, data)
        if self._sandboxed:
            program.check_sandboxable()
        self._programs.put(user, program)
        return Uploaded(program.id, program.label, program.isolated)

    # -- instances -----------------------------------------------------------------------------------------------

    async def launch(self, user: str, request: LaunchRequest) -> str:
        """Start an instance of an uploaded program, or queue it behind the admission limits; returns its id (or
        raises ``Overloaded`` past them). ``request.token_budget`` limits the tokens it may generate and endows it
        with that many tokens' worth of pages on the market (default: the market's default endowment)."""
        self.calls["launch"] += 1
        pool = self._hosts.required()
        try:
            request = LaunchRequest.model_validate(request)  # Ray callers may pass the fields as a dict
        except ValidationError as e:  # a ValueError with one line, which crosses Ray as itself
            raise ValueError(describe_errors(e.errors())) from None
        program = self._builtins.get(request.program) or self._programs.get(user, request.program)
        if program is None:
            raise NotFound(f"no program {request.program!r}; upload it first")
        node = self._choose_node(request.node_id)
        instance_id = uuid.uuid4().hex
        runs_now = self._admission.admit(user, instance_id)  # raises Overloaded: nothing is created then
        # an isolated program: a worker of its own when sandboxed, else a dedicated host (a Ray actor made at start)
        dedicated = program.isolated and not self._sandboxed
        host = None if dedicated else pool.hosts[node]
        page_size = min(e.page_size for e in pool.services[node].endpoints.values())
        deadline_s = request.deadline_s if request.deadline_s is not None else self._default_deadline_s
        limits = InstanceLimits(deadline_s, endowment_for(request.token_budget, page_size), request.token_budget)
        launch = Launch(instance_id, user, program.id, dict(request.input), limits)
        instance = self._instances.add(InstanceRecord(launch, program, node, host, dedicated))
        self._programs.started(user, program.id)
        self._run_or_wait(instance, runs_now)
        self.launched += 1
        return instance_id

    def _run_or_wait(self, instance: InstanceRecord, runs_now: bool) -> None:
        """Start an admitted instance, or save it as waiting for a slot (a restarted launcher queues it again)."""
        instance.queued = not runs_now
        if runs_now:
            self._start(instance)
        else:
            self._memory.waiting.put((instance.id,), SavedLaunch.of(instance))
            self._leases.reclaim_if_waiting()

    def _start(self, instance: InstanceRecord) -> None:
        if instance.queued:
            self._memory.waiting.delete((instance.id,))
        instance.queued = False
        if instance.dedicated:
            instance.host = self._hosts.dedicated(instance.node_id, instance.program, self._dedicated_channels)
        trusted = instance.program.id in self._builtins_by_id  # the cluster's own programs need no sandbox
        started = instance.host.start.remote(instance.launch, instance.program, trusted)
        self._spawn(self._watch_start(instance, started))

    async def _watch_start(self, instance: InstanceRecord, started) -> None:
        """The id goes back without waiting for the host to take the instance; ``locate`` waits for it (then the
        host holds its channel). A host that could not take it ends the instance with an error, which it would
        otherwise never get; so does a dedicated host that dies while its instance runs."""
        deadline = DEDICATED_START_S if instance.dedicated else HOST_S
        try:
            await answer(started, f"the inferlet host on node {instance.node_id}", deadline)
        except Exception as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            cause = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # Ray's errors carry tracebacks
            self._finish(instance, "error", f"node {instance.node_id}'s host could not start the instance: {cause}")
            return
        instance.settled.set()
        if instance.dedicated:  # not restarted by Ray: if it dies before its one instance ends, that is lost
            with contextlib.suppress(ray.exceptions.RayError):
                await instance.host.lifetime.remote()
            if instance.ending is None:
                await self._lose([instance], f"the dedicated inferlet host on node {instance.node_id} died")

    def _choose_node(self, node_id: str | None) -> str:
        return self._hosts.choose_node(node_id, Counter(i.node_id for i in self._instances.running()))

    # -- draining a node -----------------------------------------------------------------------------------------

    async def drain(self, node: str, abort: str | None = None) -> list[str]:
        """Close ``node`` to launches; the ids of the instances still there (``abort``: end them with that reason)."""
        self._hosts.close(node)
        there = self._instances.running(lambda i: i.node_id == node and i.runner is None)
        for instance in there if abort is not None else ():
            if instance.queued or instance.host is None:
                self._finish(instance, "error", abort)
            else:
                with contextlib.suppress(ray.exceptions.RayError, NoAnswer):
                    await answer(instance.host.abort.remote(instance.id, abort), f"the host on node {node}", HOST_S)
        return [i.id for i in there]

    async def reopen(self, node: str) -> None:
        self._hosts.reopen(node)  # ``node`` was being released, but holds a replica again (control.node_release)

    async def remove_host(self, node: str, reason: str) -> None:
        """``node`` was drained: its host is stopped and takes no launch again; what still runs there ends."""
        self._hosts.remove(node)
        await self._lose(self._instances.running(lambda i: i.node_id == node and i.runner is None), reason)

    async def locate(self, user: str, instance_id: str, wait: float = 0.0) -> Location:
        """Where the instance's events and inbox are: its host (None while it waits for admission, up to ``wait``
        seconds), and its ending once known (what a client reads when the host cannot answer). One that an ingress
        replica runs is read there by the request it serves: others learn only its ending."""
        self.calls["locate"] += 1
        instance = self._instances.own(user, instance_id)
        until = instance.finished if instance.runner is not None else instance.settled
        if not until.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), min(max(wait, 0.0), 60.0))
        started = instance.settled.is_set() and not instance.queued
        return Location(instance.host if started else None, instance.ending)

    async def abort(self, user: str, instance_id: str) -> bool:
        """Stop a running instance (its pages, subscriptions and sessions are released); False if it had ended."""
        self.calls["abort"] += 1
        instance = self._instances.own(user, instance_id)
        if instance.ending is not None:
            return False
        if instance.queued:  # never started: it ends here, without a host
            self._finish(instance, "error", "aborted by its user")
            return True
        if instance.runner is not None:
            self._leases.abort(instance.runner, instance_id)
            return True
        aborted = instance.host.abort.remote(instance_id, "aborted by its user")
        return await answer(aborted, f"the inferlet host on node {instance.node_id}", HOST_S)

    async def models(self) -> list[str]:
        """The names of the models the cluster serves (every node's inferlets reach the same ones)."""
        services = self._hosts.required().services
        return sorted({name for node_services in services.values() for name in node_services.endpoints})

    async def list(self, user: str) -> list[ListedInstance]:
        return [i.listed() for i in self._instances if i.user == user]

    async def close(self) -> None:
        """The cluster stops: the stored programs leave the disk (the controller calls this before killing it)."""
        self._programs.remove_all()

    async def stats(self) -> LauncherStats:
        return LauncherStats(
            launched=self.launched,
            calls=dict(self.calls),
            ingress_replicas=self._leases.started(),
            running=self._admission.running,
            queued=self._admission.queued,
            programs=len(self._programs),
            sandbox="bubblewrap" if self._sandboxed else "off",
        )

    # -- the ingress replicas' leases of admission slots (launcher/leases.py) ------------------------------------

    async def lease(self, node: str, runner: str, handle, asks: list[SlotAsk]) -> list[SlotAnswer]:
        """More slots for ``runner`` (an ingress replica on ``node``, actor ``handle``), one per ask of one of its
        event-loop turns, in order: ``Granted`` (in its lease from now on), ``Queued`` (``slot`` waits for it),
        ``Refused`` (over the limits), or ``RunOnHost`` when its node has no view of the models."""
        self.calls["lease"] += 1
        if node not in self._hosts.required().services:
            return [RunOnHost()] * len(asks)
        return self._leases.lease(runner, handle, asks)

    async def slot(self, runner: str, ask_id: str, wait: float) -> bool:
        """For a runner whose ask was queued: True once its slot is granted (it is in the runner's lease then),
        waiting up to ``wait`` s for it."""
        return await self._leases.slot(runner, ask_id, wait)

    async def withdraw(self, runner: str, ask_id: str) -> None:
        """The request behind a queued ask went away: its place in the queue goes, or the slot granted meanwhile
        comes back."""
        self._leases.withdraw(runner, ask_id)

    async def report(self, report: RunnerReport) -> None:
        """An ingress replica's news (``RunnerReport``): the instances it began and ended, the slots it gives back."""
        self.calls["report"] += 1
        for note in report.started:
            self._note(report, note)
        self._end(report.ended)
        self._leases.reported(report).started += len(report.started)

    def _note(self, report: RunnerReport, launch: Launch) -> None:
        program = self._builtins_by_id.get(launch.program)  # (a runner runs only the cluster's own programs)
        if program is None or launch.id in self._instances:
            return
        self._instances.add(InstanceRecord.run_by(report.runner, report.node, launch, program))
        self._programs.started(launch.user, program.id)
        self.launched += 1

    async def services_for(self, node: str) -> RunnerServices:
        """What instances a runner on ``node`` runs reach, and with what (``RunnerServices``)."""
        pool = self._hosts.pool
        return RunnerServices(pool.services[node], pool.secret, self._leases.services, self._default_deadline_s)

    async def orders(self, runner: str, wait: float = 30.0) -> RunnerOrders:
        """What the runner is to do (aborts, slots to give back, new services): a long poll it keeps open."""
        return await self._leases.orders(runner, wait)

    async def _runner_died(self, runner: str) -> None:
        lost = self._instances.running(lambda i: i.runner == runner)
        await self._lose(lost, "the ingress replica that ran it died; the instance was lost with it")

    # -- the host side -------------------------------------------------------------------------------------------

    async def ended(self, batch: list[Ending]) -> None:
        """Instances' terminal events, from the hosts that ran them (one call per loop turn of a host)."""
        self.calls["ended"] += 1
        self._end(batch)

    def _end(self, batch: list[Ending] | tuple[Ending, ...]) -> None:
        for ending in batch:
            instance = self._instances.get(ending.instance)
            if instance is not None:
                self._finish(instance, ending.kind, ending.value)

    def _finish(self, instance: InstanceRecord, kind: str, value: str | bytes) -> None:
        """The instance ended (``kind`` is ``return`` or ``error``): its admission slot goes to the next waiting
        launch, and it stays listed until ``keep_finished`` newer ones have ended."""
        if instance.ending is not None or kind not in TERMINAL:
            return
        instance.ending, instance.ended = (kind, value), time.time()
        instance.settled.set()
        instance.finished.set()
        self._programs.ended(instance.user, instance.program.id)
        if instance.queued:
            self._admission.withdraw(instance.user, instance.id)
            self._memory.waiting.delete((instance.id,))
        elif instance.runner is None:  # (one an ingress replica ran held a slot of its lease: that slot stays there)
            self._leases.release(instance.user)
        if instance.dedicated and instance.host is not None:  # None: it ended while waiting for admission
            # kept a while, so that its client reads the events it has not read yet
            asyncio.get_running_loop().call_later(DEDICATED_GRACE_S, ray.kill, instance.host)
        self._instances.listed_after_end(instance)
