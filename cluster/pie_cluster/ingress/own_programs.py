"""The cluster's own programs run where their request lands: in the ingress replica's process.

An OpenAI request needs no sandbox (the serving program is ours) and no node host: it takes an admission slot of its
user's from this replica's lease (``ingress/slot_lease.py``: no call, unless the lease has none free), runs the
program here as an asyncio task that talks to the replica's socket directly, and streams its events from this
process's memory, so no event crosses an actor. The launcher hears that it began and how it ended in this replica's
reports (it keeps listing and abort). What the instance reaches (models, market, bus) and the secret that mints its
capability come from the launcher once per change of the cluster's services.

When a model has several replicas, each instance run here is given the one ``routing`` picks for its prompt
(the replica that most likely holds its prefix in cache, unless that one is far busier) in place of the node's
default endpoint. Only these programs are placed so: uploaded programs run on node hosts and reach the node's one
endpoint per model (``NodeServices.endpoints``), as before. Each endpoint names the model's other replicas, then
this process's relay to whichever serves, to fail over to (``inferlet._failover``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.exceptions
from inferlet import runtime
from inferlet.runtime import ModelEndpoint
from pie_workers.deadlines import LAUNCHER_S, NoAnswer, answer
from pie_workers.wire import capability

from pie_cluster.hosts.events import TERMINAL, Channel, Channels
from pie_cluster.hosts.model_files import local_endpoints
from pie_cluster.hosts.node_host import CAPABILITY_MARGIN_S, CAPABILITY_TTL_S, NodeServices
from pie_cluster.hosts.replica_relay import ReplicaRelays, every_replica_failing_over
from pie_cluster.hosts.revocations import Revoker
from pie_cluster.hosts.run import serve_instance
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.ingress.routing import PrefixRouter, Prompt
from pie_cluster.ingress.slot_lease import SlotLease
from pie_cluster.instance import InstanceLimits, InstanceSetup, Launch
from pie_cluster.launcher.records import RunnerServices
from pie_cluster.limits import ChannelLimits
from pie_cluster.programs.program import Main, Program

log = logging.getLogger("pie.http")


@dataclass
class LocalRun:
    """One instance run in this process: its launch (as reported to the launcher, without its input) and its state."""

    launch: Launch
    wallet: _Wallet | None  # its market wallet while this process holds it (then ``run_inferlet`` does)
    task: asyncio.Task | None = None
    abort_reason: str | None = None
    holds_slot: bool = True  # its admission slot (of this replica's lease) is still its own


@dataclass(frozen=True)
class _Services:
    version: int
    services: NodeServices
    secret: bytes
    deadline_s: float | None
    endpoints: dict[str, ModelEndpoint]  # model_dir on this node
    replicas: dict[str, dict[str, ModelEndpoint]]  # model -> address -> replica (model_dir on this node)


@dataclass
class _Wallet:
    """An instance's wallet, being opened on ``market`` as the instance begins."""

    market: object
    joining: asyncio.Future  # the credits it opened with

    async def opened(self) -> float | None:
        """Its credits; None when the market did not open it (``run_inferlet`` tries again, and says why)."""
        try:
            return await self.joining
        except Exception:
            return None

    async def close(self, instance_id: str) -> None:
        if await self.opened() is not None:
            with contextlib.suppress(Exception):  # a market that cannot close it now: it is one wallet, empty
                await wallet_calls(self.market).leave(instance_id)


class _Session:
    """``inferlet.session`` of an instance run here: its events out, its channel's inbox in."""

    def __init__(self, runner: LocalInstances, run: LocalRun, channel: Channel):
        self._runner, self._run, self._channel = runner, run, channel

    def send(self, text: str) -> None:
        self._runner.emit(self._run, "message", text)

    def send_file(self, data: bytes) -> None:
        self._runner.emit(self._run, "file", bytes(data))

    async def receive(self) -> str:
        return await self._channel.receive("message")

    async def receive_file(self) -> bytes:
        return await self._channel.receive("file")


class LocalInstances:
    def __init__(self, launcher, programs: dict[str, Path], router: PrefixRouter):
        """``programs``: the cluster's own programs by name (``programs.BUILTINS``); ``router``: how requests
        are spread over a model's replicas (``[server] routing``, ``[cache] share``)."""
        self._launcher = launcher
        self._programs = {name: Program.from_path(path) for name, path in programs.items()}
        self._mains: dict[str, Main] = {}
        self.name = uuid.uuid4().hex  # this runner, to the launcher
        self._node = ray.get_runtime_context().get_node_id()
        self._lease = SlotLease(launcher, self._node, self.name, ray.get_runtime_context().current_actor)
        self._services: _Services | None = None
        self._services_version = 0  # the one the launcher last told of: another one held is fetched again
        self._fetching = asyncio.Lock()
        self._channels = Channels(ChannelLimits(keep_finished=256), ended=self._lease.ended, exceeded=self.abort)
        self._revoker = Revoker(self._revokers)  # runs' capabilities, revoked everywhere once their runs are done
        self._runs: dict[str, LocalRun] = {}
        self._listening: asyncio.Task | None = None
        self._router = router
        self._relays = ReplicaRelays(self._replica_addresses)
        self._closing: set[asyncio.Task] = set()  # wallets being closed
        self._endowment: float | None = None  # what the market opens the wallets of the cluster's programs with

    async def start(
        self, user: str, program: str, input: dict, prompt: Prompt | None = None
    ) -> tuple[str, Channel] | None:
        """Start an instance of ``program`` for ``user`` on a slot of this replica's lease; its id and channel, or
        None when this node cannot run it (no view of the models here: launch it on a host). ``prompt``: its model
        and prompt text, to place it on one of the model's replicas (None: the node's default one). Raises the
        launcher's refusal (``Overloaded``)."""
        if not await self._lease.acquire(user):
            return None
        if self._listening is None:  # the launcher knows this runner from its first ask on
            self._listening = asyncio.get_running_loop().create_task(self._listen_for_orders())
        instance_id = uuid.uuid4().hex
        channel = self._channels.open(instance_id, user)
        run = LocalRun(Launch(instance_id, user, self._programs[program].id, {}), wallet=None)
        # launched first, its program's first step (prompt, context) runs before the calls below are submitted
        self._launch(run, program, input, prompt)
        run.wallet = self._open_wallet(instance_id)
        self._lease.started(run.launch)
        return instance_id, channel

    def _launch(self, run: LocalRun, program: str, input: dict, prompt: Prompt | None) -> None:
        self._runs[run.launch.id] = run
        run.task = asyncio.get_running_loop().create_task(self._run(run, program, input, prompt))
        run.task.add_done_callback(lambda _: self._ended(run))

    def _ended(self, run: LocalRun) -> None:
        """Whatever wallet the run still holds (cancelled before it began, too) is closed."""
        self._close_wallet(run.launch.id, run.wallet)
        self._free_slot(run)

    def _free_slot(self, run: LocalRun) -> None:
        """The run's slot is free from its ending on, as a host's instance's is (its cleanup may take longer): the
        report that carries the ending then says the slot is idle, for launches that wait."""
        if run.holds_slot:
            run.holds_slot = False
            self._lease.free(run.launch.user)

    def _revokers(self) -> tuple:
        return self._services.services.revokers if self._services is not None else ()

    def abort(self, instance_id: str, reason: str) -> bool:
        """Cancel a run here, which then ends with an error saying ``reason``; False if none runs."""
        run = self._runs.get(instance_id)
        if run is None or run.task.done():
            return False
        run.abort_reason = reason
        run.task.cancel()
        return True

    def _open_wallet(self, instance_id: str) -> _Wallet | None:
        """Open the instance's market wallet on the market this process knows (none before its first instance's
        services: ``run_inferlet`` opens that one), without waiting for the market's answer."""
        market = self._services.services.market if self._services is not None else None
        if market is None:
            return None
        return _Wallet(market, asyncio.ensure_future(wallet_calls(market).join(instance_id, None)))

    def _close_wallet(self, instance_id: str, wallet: _Wallet | None) -> None:
        """Close a wallet this process opened (once the market answered its opening)."""
        if wallet is not None:
            task = asyncio.ensure_future(wallet.close(instance_id))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _run(self, run: LocalRun, program: str, input: dict, prompt: Prompt | None) -> None:
        instance_id, user = run.launch.id, run.launch.user
        placed: str | None = None  # the replica the router chose, counted in flight there until this ends
        try:
            try:
                services = await self._current()
            except Exception as e:  # the launcher or the models' files cannot be reached
                self.emit(run, "error", f"the ingress could not prepare the instance: {e}")
                return
            opening, market = await self._opening(run, services.services.market)
            endpoints = services.endpoints
            replicas = services.replicas.get(prompt.model, {}) if prompt is not None else {}
            if len(replicas) > 1:
                keys, salt = list(replicas), prompt.cache_salt
                placed = self._router.choose(prompt.model, keys, prompt.text, prompt.tag, prompt.follows, user, salt)
                endpoints = {**endpoints, prompt.model: replicas[placed]}
            ttl = (services.deadline_s or CAPABILITY_TTL_S) + CAPABILITY_MARGIN_S
            minting = self._revoker.minted(instance_id, ttl)
            setup = InstanceSetup(
                instance_id=instance_id,
                username=user,
                capability=capability.mint(
                    services.secret, user, instance_id, ttl, models=tuple(endpoints), minting=minting
                ),
                endpoints=endpoints,
                bus=services.services.bus,
                mcp_servers=services.services.mcp_servers,
                limits=InstanceLimits(deadline_s=services.deadline_s),
                opening_balance=opening,
            )
            if market is not None:
                run.wallet = None  # from here on, run_inferlet closes it
            await serve_instance(
                self._programs[program],
                lambda: self._main(program, instance_id),
                input,
                setup,
                lambda kind, value: self.emit(run, kind, value),
                _Session(self, run, self._channels.find(instance_id)),
                aborted=lambda: run.abort_reason or "aborted",
                market=market,
            )
        finally:
            del self._runs[instance_id]
            self._revoker.ended([instance_id])
            if placed is not None:
                self._router.finished(prompt.model, placed)

    async def _opening(self, run: LocalRun, market) -> tuple[float | None, object | None]:
        """The credits ``run``'s wallet opens with, and the market ``run_inferlet`` is to close it on (None: the run's
        own ``wallet`` is closed when it ends). Once this process knows what the market endows the cluster's programs
        with, a run does not wait for its wallet to open: its program starts while the market's answer is on its way
        (a market round that names the instance before the wallet opens bills it nothing for that round)."""
        wallet = run.wallet
        if wallet is not None and wallet.market != market:  # the market moved meanwhile: run_inferlet opens one there
            self._close_wallet(run.launch.id, wallet)
            run.wallet = wallet = None
        if wallet is None:
            return None, market
        if self._endowment is not None:
            return self._endowment, None
        self._endowment = opening = await wallet.opened()
        if opening is None:  # the market did not open it: run_inferlet tries again, and says why
            self._close_wallet(run.launch.id, wallet)
            run.wallet = None
        return opening, market

    def _main(self, program: str, instance_id: str) -> Main:
        """The program's main (loaded once per process: the cluster's programs keep no state in their modules),
        marking on the instance's channel when it begins."""
        if program not in self._mains:
            self._mains[program] = self._programs[program].load_main()
        main, channel = self._mains[program], self._channels.find(instance_id)

        async def begun(input: dict):
            channel.started = time.perf_counter()
            try:
                return await main(input)
            finally:
                channel.first_pass = runtime.current().first_generated_at

        return begun

    async def _current(self) -> _Services:
        async with self._fetching:
            if self._services is None or self._services.version != self._services_version:
                ref = self._launcher.services_for.remote(self._node)
                fetched: RunnerServices = await answer(ref, "the launcher", LAUNCHER_S)
                self._services_version = fetched.version
                services = fetched.services
                endpoints = await local_endpoints(services.endpoints, services.model_files)
                relays = {name: await self._relays.address_for(name) for name in endpoints}
                endpoints, replicas = every_replica_failing_over(endpoints, services.replicas, relays)
                for name, options in replicas.items():
                    self._router.forget(name, keep=list(options))  # a replaced replica's record goes with it
                self._services = _Services(
                    fetched.version, services, fetched.secret, fetched.deadline_s, endpoints, replicas
                )
            return self._services

    def emit(self, run: LocalRun, kind: str, value: str | bytes) -> None:
        self._channels.emit(run.launch.id, kind, value)
        if kind in TERMINAL:
            self._free_slot(run)

    def _replica_addresses(self, model: str) -> list[str]:
        """The model's replicas as the launcher knows them now, this node's first (what the relay tries: asked each
        time, since this process learns of a replacement only at its next admission). Runs on the relay's thread."""
        try:
            services = ray.get(self._launcher.services_for.remote(self._node), timeout=LAUNCHER_S).services
        except Exception:  # the launcher does not answer now: what this process knew
            services = self._services.services if self._services is not None else None
        if services is None or model not in services.endpoints:
            return []
        replicas = [e.address for e in services.replicas.get(model, ())]
        return list(dict.fromkeys([services.endpoints[model].address, *replicas]))

    async def _listen_for_orders(self) -> None:
        """The launcher's orders (``RunnerOrders``), over one long poll: aborts of instances run here (``DELETE
        /v1/instances/{id}``), idle slots to give back, services to fetch again."""
        while True:
            try:
                polled = self._launcher.orders.remote(self.name, 30.0)
                orders = await answer(polled, "the launcher", 30 + LAUNCHER_S)
            except (ray.exceptions.RayError, NoAnswer):
                await asyncio.sleep(1.0)
                continue
            self._services_version = orders.services
            if orders.reclaim:
                self._lease.give_back_idle()
            for instance_id in orders.aborts:
                self.abort(instance_id, "aborted by its user")
