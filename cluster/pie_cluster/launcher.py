"""The launcher: one named actor that owns programs, instances and their event streams.

Clients (the HTTP app, ``pie submit`` through Ray Jobs) call it with the authenticated user's name; every
program belongs to the users who uploaded it and every instance to the user who launched it, and another user's
program or instance is reported as not existing (the same answer as a wrong id, so ids cannot be probed). Instances
run on inferlet hosts (``inferlet_host``): the pooled host of a node that serves the models (least busy first) or of
the node asked for, or — only when the sandbox is off — a dedicated host for programs that want isolation.
Finished instances stay listed (and attachable) until ``keep_finished`` newer ones have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import ray
import ray.exceptions
from pie_workers.deadlines import DEDICATED_START_S, HOST_S, MARKET_S, NoAnswer, answer
from pydantic import ValidationError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.admission import Admission
from pie_cluster.config import LauncherConfig, SupervisionConfig
from pie_cluster.events import EventLog
from pie_cluster.host_watch import until_gone
from pie_cluster.inferlet_host import InferletHost, InstanceLimits, NodeServices
from pie_cluster.launch_request import LaunchRequest, describe_errors
from pie_cluster.market import endowment_for
from pie_cluster.program_store import ProgramStore
from pie_cluster.programs import Program, ProgramError


class NotFound(LookupError):
    """No such instance or program for this user."""


OPENAI_PROGRAM = "pie:openai-completions"
"""The built-in program serving the OpenAI-compatible routes, launched by this id like any uploaded program."""
RESPONSES_PROGRAM = "pie:openai-responses"
"""The built-in program serving ``POST /v1/responses``: one turn of a conversation kept as a snapshot."""
_BUILTINS = {
    OPENAI_PROGRAM: Path(__file__).parent / "builtin" / "openai_completions.py",
    RESPONSES_PROGRAM: Path(__file__).parent / "builtin" / "openai_responses_api.py",
}


@dataclass
class _Instance:
    id: str
    user: str
    program: Program
    input: dict
    node_id: str
    host: object | None  # its inferlet host actor (None until a dedicated one is made at its start)
    dedicated: bool
    log: EventLog
    created: float = field(default_factory=time.time)
    ended: float | None = None
    inbox: dict[str, asyncio.Queue] = field(
        default_factory=lambda: {"message": asyncio.Queue(), "file": asyncio.Queue()}
    )
    waiting: set[asyncio.Future] = field(default_factory=set)
    start: InstanceLimits | None = None  # what to start it with, kept while it waits for admission
    queued: bool = False

    def summary(self) -> dict:
        end = self.ended or time.time()
        if self.log.terminal is not None:
            status = {"return": "finished", "error": "failed"}[self.log.terminal.kind]
        else:
            status = "queued" if self.queued else "running"
        return {
            "id": self.id,
            "program": self.program.label,
            "status": status,
            "node": self.node_id,
            "input": self.input,
            "created": self.created,
            "elapsed_s": round(end - self.created, 3),
        }


def _store_directory(parent: str | None) -> Path:
    """A new directory for the uploaded programs, readable by this OS user only, under ``parent`` (default: the
    system's temporary directory)."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="pie-program-store-", dir=parent))  # mode 0700


@dataclass
class HostPool:
    """What the controller hands the launcher: a pooled host per node and what inferlets on each node reach."""

    hosts: dict[str, object]  # node id -> InferletHost actor
    services: dict[str, NodeServices]  # node id -> its models (ipc on that node, else tcp), bus, MCP, market
    secret: bytes  # the cluster's, for the dedicated hosts to mint their instances' capabilities with
    model_nodes: tuple[str, ...] = ()  # nodes that serve at least one replica: preferred for co-location


class Launcher:
    def __init__(self, config: LauncherConfig, sandboxed: bool, supervision: SupervisionConfig):
        """``sandboxed``: uploaded programs run in the nodes' sandboxed workers (``[sandbox]`` is not off), so a
        manifest may not ask for a Ray runtime_env and an isolated program gets a worker, not a Ray actor, of its
        own; ``supervision``: how pooled hosts are pinged (a hung one is killed for Ray to restart)."""
        self._supervision = supervision
        self._pool: HostPool | None = None
        self._sandboxed = sandboxed
        self._programs = ProgramStore(_store_directory(config.program_store_dir), config.program_store_mib << 20)
        self._builtins = {name: Program.from_path(path) for name, path in _BUILTINS.items()}
        self._builtin_ids = {program.id for program in self._builtins.values()}
        self._admission = Admission(config.admission_limits())
        self._instances: dict[str, _Instance] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._event_capacity = config.event_buffer
        self._keep_finished = config.keep_finished
        self._default_deadline_s = config.default_deadline_s
        self._watching: set[asyncio.Task] = set()
        self._down: set[str] = set()  # nodes whose pooled host is dead (restarting, or its node is lost)
        self.launched = 0

    async def attach_pool(self, pool: HostPool) -> None:
        self._pool = pool
        for node, host in pool.hosts.items():
            self._spawn(self._watch_host(node, host))

    async def add_host(self, node: str, host, services: dict[str, NodeServices]) -> None:
        """A node joined: its pooled host takes launches from now on, watched like the others (``services``: every
        node's, the new one's included)."""
        self._pool = dataclasses.replace(self._pool, hosts={**self._pool.hosts, node: host}, services=services)
        self._spawn(self._watch_host(node, host))

    async def set_services(self, services: dict[str, NodeServices]) -> None:
        """Replicas were replaced: what each node's instances reach from now on (dedicated hosts made later, and
        pooled hosts that Ray restarts, get these)."""
        self._pool = dataclasses.replace(self._pool, services=services)

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _watch_host(self, node: str, host) -> None:
        """A pooled host that dies (its process killed, its node lost) or hangs (then it is killed) takes its
        instances with it: they end with an error event and their wallets close. Ray restarts the host; launches on
        the node then work again."""
        while True:
            await until_gone(node, host, self._supervision)
            lost = [i for i in self._instances.values() if i.host is host and not i.queued and i.log.terminal is None]
            self._down.add(node)
            await self._lose(lost, f"the inferlet host on node {node} died; the instance was lost with it")
            while True:  # until Ray has restarted it (a lost node's host never comes back)
                try:
                    await asyncio.wait_for(host.ready.remote(), timeout=30)
                    services = host.set_services.remote(self._pool.services[node])  # it restarted with the first ones
                    await answer(services, f"the inferlet host on node {node}", HOST_S)
                    self._down.discard(node)
                    break
                except (ray.exceptions.RayError, TimeoutError):
                    await asyncio.sleep(1.0)

    async def _lose(self, lost: list[_Instance], message: str) -> None:
        """Instances whose host died: their wallets close and they end with ``message``."""
        for instance in lost:
            market = self._pool.services[instance.node_id].market
            if market is not None:
                with contextlib.suppress(ray.exceptions.RayError, NoAnswer):
                    await answer(market.leave.remote(instance.id), "the market", MARKET_S)
        await self.emit([(instance.id, "error", message) for instance in lost])

    # -- programs ------------------------------------------------------------------------------------------------

    async def upload(self, user: str, filename: str, data: bytes) -> dict:
        """Store a program for ``user`` (a .py file or a .zip with pie.toml); returns its id and name@version."""
        program = Program.from_upload(filename, data)
        if self._sandboxed and program.runtime_env is not None:
            raise ProgramError(
                f"{program.label}: pie.toml's [inferlet.runtime_env] is refused: programs run in the cluster's "
                "sandbox with its Python environment (an operator whose users are all trusted may allow it with "
                '[sandbox] mode = "off")'
            )
        self._programs.put(user, program)
        return {"program": program.id, "name": program.label, "isolated": program.isolated}

    # -- instances -----------------------------------------------------------------------------------------------

    async def launch(self, user: str, request: LaunchRequest) -> str:
        """Start an instance of an uploaded program, or queue it behind the admission limits; returns its id (or
        raises ``Overloaded`` past them). ``request.token_budget`` limits the tokens it may generate and endows it
        with that many tokens' worth of pages on the market (default: the market's default endowment)."""
        if self._pool is None:
            raise RuntimeError("the launcher has no inferlet hosts yet (is the cluster started?)")
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
        # sandboxed, the pooled host gives an isolated program a worker of its own; otherwise it gets a dedicated
        # host (a Ray actor, made when it starts)
        dedicated = program.isolated and not self._sandboxed
        host = None if dedicated else self._pool.hosts[node]
        log = EventLog(self._event_capacity)
        instance = _Instance(instance_id, user, program, dict(request.input), node, host, dedicated, log)
        self._instances[instance_id] = instance
        self._programs.started(user, program.id)
        page_size = min(e.page_size for e in self._pool.services[node].endpoints.values())
        deadline_s = request.deadline_s if request.deadline_s is not None else self._default_deadline_s
        endowment = endowment_for(request.token_budget, page_size)
        instance.start = InstanceLimits(deadline_s, endowment, request.token_budget)
        instance.queued = not runs_now
        if runs_now:
            self._start(instance)
        self.launched += 1
        return instance_id

    def _start(self, instance: _Instance) -> None:
        limits, instance.start, instance.queued = instance.start, None, False
        if instance.dedicated:
            instance.host = self._dedicated_host(instance.node_id, instance.program)
        trusted = instance.program.id in self._builtin_ids  # the cluster's own programs need no sandbox
        started = instance.host.start.remote(
            instance.id, instance.program, instance.input, instance.user, limits, trusted
        )
        self._spawn(self._watch_start(instance, started))

    async def _watch_start(self, instance: _Instance, started) -> None:
        """The id goes back without waiting for the host to take the instance (its events follow soon); a host
        that could not take it ends the instance with an error event, which it would otherwise never get; so does a
        dedicated host that dies while its instance runs."""
        deadline = DEDICATED_START_S if instance.dedicated else HOST_S
        try:
            await answer(started, f"the inferlet host on node {instance.node_id}", deadline)
        except Exception as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            cause = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # Ray's errors carry tracebacks
            message = f"the inferlet host on node {instance.node_id} could not start the instance: {cause}"
            await self.emit([(instance.id, "error", message)])
            return
        if instance.dedicated:  # not restarted by Ray: if it dies before its one instance ends, that is lost
            with contextlib.suppress(ray.exceptions.RayError):
                await instance.host.lifetime.remote()
            if instance.log.terminal is None:
                await self._lose([instance], f"the dedicated inferlet host on node {instance.node_id} died")

    def _choose_node(self, node_id: str | None) -> str:
        hosts = self._pool.hosts
        if node_id is not None:
            if node_id not in hosts:
                raise ValueError(f"no inferlet host on node {node_id!r}; nodes: {', '.join(sorted(hosts))}")
            if node_id in self._down:
                raise RuntimeError(f"the inferlet host on node {node_id} is down (restarting, or its node is lost)")
            return node_id
        up = [n for n in hosts if n not in self._down]
        if not up:
            raise RuntimeError("every node's inferlet host is down")
        preferred = [n for n in self._pool.model_nodes if n in up] or up
        load = {n: 0 for n in preferred}
        for inst in self._instances.values():
            if inst.log.terminal is None and inst.node_id in load:
                load[inst.node_id] += 1
        return min(preferred, key=lambda n: load[n])

    def _dedicated_host(self, node: str, program: Program):
        options = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}
        if program.runtime_env:
            options["runtime_env"] = program.runtime_env
        launcher = ray.get_runtime_context().current_actor
        host = ray.remote(InferletHost).options(**options)
        return host.remote(launcher, self._pool.services[node], self._pool.secret)

    async def events(self, user: str, instance_id: str, since: int = 0, timeout: float = 10.0) -> dict:
        """Events numbered ``since`` and later, waiting up to ``timeout`` s for one (a long poll)."""
        instance = self._own(user, instance_id)
        got = await instance.log.wait(since, min(max(timeout, 0.0), 60.0))
        return {
            "events": [e.as_wire() for e in got],
            "next": got[-1].index + 1 if got else max(since, 0),
            "done": instance.log.done and (not got or got[-1] is instance.log.terminal),
        }

    async def send(self, user: str, instance_id: str, message: str) -> None:
        self._inbox(user, instance_id, "message").put_nowait(message)

    async def send_file(self, user: str, instance_id: str, data: bytes) -> None:
        self._inbox(user, instance_id, "file").put_nowait(bytes(data))

    async def abort(self, user: str, instance_id: str) -> bool:
        """Stop a running instance (its pages, subscriptions and sessions are released); False if it had ended."""
        instance = self._own(user, instance_id)
        if instance.log.done:
            return False
        if instance.queued:  # never started: it ends here, without a host
            await self.emit([(instance_id, "error", "aborted by its user")])
            return True
        aborted = instance.host.abort.remote(instance_id, "aborted by its user")
        return await answer(aborted, f"the inferlet host on node {instance.node_id}", HOST_S)

    async def models(self) -> list[str]:
        """The names of the models the cluster serves (every node's inferlets reach the same ones)."""
        if self._pool is None:
            raise RuntimeError("the launcher has no inferlet hosts yet (is the cluster started?)")
        return sorted({name for services in self._pool.services.values() for name in services.endpoints})

    async def list(self, user: str) -> list[dict]:
        return [i.summary() for i in self._instances.values() if i.user == user]

    async def close(self) -> None:
        """The cluster stops: the stored programs leave the disk (the controller calls this before killing it)."""
        self._programs.remove_all()

    async def stats(self) -> dict:
        return {
            "launched": self.launched,
            "running": self._admission.running,
            "queued": self._admission.queued,
            "programs": len(self._programs),
            "sandbox": "bubblewrap" if self._sandboxed else "off",
        }

    # -- the host side -------------------------------------------------------------------------------------------

    async def emit(self, batch: list[tuple[str, str, str | bytes]]) -> None:
        for instance_id, kind, value in batch:
            instance = self._instances.get(instance_id)
            if instance is None or instance.log.done:
                continue
            instance.log.append(kind, value)
            if instance.log.done:
                self._ended(instance)

    async def receive(self, instance_id: str, kind: str):
        """An instance waits for what its client sends (called by its host, never by clients)."""
        instance = self._instances.get(instance_id)
        if instance is None or instance.log.done:
            raise RuntimeError(f"instance {instance_id} has ended")
        waiter = asyncio.ensure_future(instance.inbox[kind].get())
        instance.waiting.add(waiter)
        try:
            return await waiter
        finally:
            instance.waiting.discard(waiter)

    def _ended(self, instance: _Instance) -> None:
        instance.ended = time.time()
        self._programs.ended(instance.user, instance.program.id)
        if instance.queued:
            self._admission.withdraw(instance.user, instance.id)
        else:
            for waiting in self._admission.ended(instance.user):
                self._start(self._instances[waiting])
        for waiter in list(instance.waiting):
            waiter.cancel()
        if instance.dedicated and instance.host is not None:  # None: it ended while waiting for admission
            ray.kill(instance.host)
        self._finished[instance.id] = None
        while len(self._finished) > self._keep_finished:
            old, _ = self._finished.popitem(last=False)
            self._instances.pop(old, None)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _own(self, user: str, instance_id: str) -> _Instance:
        instance = self._instances.get(instance_id)
        if instance is None or instance.user != user:
            raise NotFound(f"no instance {instance_id!r}")
        return instance

    def _inbox(self, user: str, instance_id: str, kind: str) -> asyncio.Queue:
        instance = self._own(user, instance_id)
        if instance.log.done:
            raise ValueError(f"instance {instance_id} has ended; it can no longer receive")
        return instance.inbox[kind]
