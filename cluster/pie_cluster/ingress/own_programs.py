"""The cluster's own programs run where their request lands: in the ingress replica's process.

An OpenAI request needs no sandbox (the serving program is ours) and no node host: the ingress asks the launcher to
admit it (one call; the launcher keeps admission, listing and abort), runs the program here as an asyncio task that
talks to the replica's socket directly, and streams its events from this process's memory, so no event crosses an
actor. The launcher hears once how it ended. When the launcher's last answer left the user room for more, the
instance begins while its admission is on its way, and is undone unseen if that answer queues or refuses it
(``ingress.own_program_runs``). What the instance reaches (models, market, bus) and the secret that
mints its capability come from the launcher once per change of the cluster's services.

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
from prometheus_client import Counter

from pie_cluster.coalesced_calls import CoalescedCalls
from pie_cluster.config import ChannelLimits
from pie_cluster.hosts.events import TERMINAL, Channel, Channels, Ending
from pie_cluster.hosts.model_files import local_endpoints
from pie_cluster.hosts.node_host import CAPABILITY_MARGIN_S, CAPABILITY_TTL_S, NodeServices
from pie_cluster.hosts.replica_relay import ReplicaRelays, every_replica_failing_over
from pie_cluster.hosts.revocations import Revoker
from pie_cluster.hosts.run import InstanceSetup, serve_instance
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.ingress.own_program_runs import Headroom, LocalRun
from pie_cluster.ingress.routing import PrefixRouter, Prompt
from pie_cluster.launcher.records import AdmitRequest, Admitted, Refused, RunOnHost
from pie_cluster.programs.program import Main, Program

log = logging.getLogger("pie.http")
UNDONE_CLEANUP_S = 2.0
"""How long a request waits for the cleanup of its run begun early and undone (releasing its contexts, closing its
wallet) before it runs again: a run begun on a replica that died since may take its failover's deadlines to end."""


@dataclass(frozen=True)
class _Services:
    version: int
    services: NodeServices
    secret: bytes
    endpoints: dict[str, ModelEndpoint]  # model_dir on this node
    replicas: dict[str, dict[str, ModelEndpoint]]  # model -> address -> replica (model_dir on this node)


@dataclass
class _Wallet:
    """An instance's wallet, being opened on ``market`` while the launcher admits the instance."""

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
    def __init__(self, launcher, programs: dict[str, Path], early_starts: Counter, router: PrefixRouter):
        """``programs``: the cluster's own programs by name (the launcher's ``BUILTINS``); ``early_starts``: the
        count of instances begun before their admission answered, by ``outcome`` (kept or undone); ``router``:
        how requests are spread over a model's replicas (``[server] routing``, ``[cache] share``)."""
        self._launcher = launcher
        self._programs = {name: Program.from_path(path) for name, path in programs.items()}
        self._mains: dict[str, Main] = {}
        self.name = uuid.uuid4().hex  # this runner, to the launcher
        self._node = ray.get_runtime_context().get_node_id()
        self._actor = ray.get_runtime_context().current_actor
        self._services: _Services | None = None
        self._fetching = asyncio.Lock()
        self._channels = Channels(ChannelLimits(keep_finished=256), ended=launcher.ended.remote, exceeded=self.abort)
        self._revoker = Revoker(self._revokers)  # runs' capabilities, revoked everywhere once their runs are done
        self._runs: dict[str, LocalRun] = {}
        self._headroom = Headroom()
        self._early_starts = early_starts
        self._listening: asyncio.Task | None = None
        self._router = router
        self._relays = ReplicaRelays(self._replica_addresses)
        self._closing: set[asyncio.Task] = set()  # wallets being closed
        self._endowment: float | None = None  # what the market opens the wallets of the cluster's programs with
        # the admissions of one event-loop turn (a burst of requests) go to the launcher as one call
        runner = (self._node, self.name, self._actor)
        self._admit = CoalescedCalls(launcher.admit_many, "the launcher", LAUNCHER_S, *runner)

    async def start(
        self, user: str, program: str, input: dict, prompt: Prompt | None = None
    ) -> tuple[str, Channel] | None:
        """Admit and start an instance of ``program`` for ``user``; its id and channel, or None when this node
        cannot run it (no view of the models here: launch it on a host). ``prompt``: its model and prompt text, to
        place it on one of the model's replicas (None: the node's default one). Raises the launcher's refusal
        (``Overloaded``). While the launcher's answer is on its way, the instance begins when the last answers
        left its user room for it (``ingress.own_program_runs``)."""
        instance_id = uuid.uuid4().hex
        # begun first, its program's first step (prompt, context) runs before the calls below are submitted
        early = self._begin_early(instance_id, user, program, input, prompt)
        wallet = self._open_wallet(instance_id)
        if early is not None:
            early.wallet = wallet
        admission = asyncio.ensure_future(self._admit(AdmitRequest(instance_id, user, program, input)))
        try:
            admitted = await asyncio.shield(admission)
        except BaseException:
            admission.add_done_callback(lambda answer: self._end_unstarted(instance_id, answer))
            if early is not None:
                self._undo(early)  # (its wallet goes with it)
            else:
                self._close_wallet(instance_id, wallet)
            raise
        finally:
            if early is not None:
                self._headroom.answered(user)
        self._headroom.heard(user, admitted)
        if self._listening is None and isinstance(admitted, Admitted):  # the launcher knows this runner from now on
            self._listening = asyncio.get_running_loop().create_task(self._listen_for_aborts())
        if early is not None:
            if early.admitted_as_begun(admitted):
                self._early_starts.labels("kept").inc()
                return instance_id, self._confirm(early)
            self._early_starts.labels("undone").inc()
            undone = self._undo(early)  # (its wallet goes with it)
            wallet = None
        elif not isinstance(admitted, Admitted) or admitted.queued:
            self._close_wallet(instance_id, wallet)  # refused, run elsewhere, or waiting: it opens one later
            wallet = None
        if isinstance(admitted, Refused):  # this request's own answer
            raise admitted.error()
        if isinstance(admitted, RunOnHost):
            return None
        try:
            if early is not None:  # this id's run again starts after that one's cleanup, or a bounded wait for it
                await asyncio.wait([undone], timeout=UNDONE_CLEANUP_S)
            while admitted.queued:
                ref = self._launcher.admitted.remote(self.name, instance_id, LAUNCHER_S)
                admitted = await answer(ref, "the launcher", 2 * LAUNCHER_S)
        except BaseException:  # its client went away (or the launcher did not answer): its slot must come back
            ending = "its request ended while it waited for a slot (its client went away, or no answer came)"
            self._launcher.ended.remote([Ending(instance_id, "error", ending)])
            raise
        channel = self._channels.open(instance_id, user)
        if admitted.ending is not None:  # aborted while it waited
            channel.log.append(*admitted.ending)
            return instance_id, channel
        run = LocalRun(instance_id, admitted.services, admitted.deadline_s, wallet)
        self._launch(run, program, input, user, prompt)
        return instance_id, channel

    def _begin_early(
        self, instance_id: str, user: str, program: str, input: dict, prompt: Prompt | None
    ) -> LocalRun | None:
        """Begin the instance before its admission answers, when this process knows the services it would run
        with and the launcher's last answers left ``user`` room for it; None otherwise."""
        if self._services is None or self._services.version != self._headroom.services_version:
            return None  # (services the launcher has moved on from: a run begun on them would be undone)
        if not self._headroom.take(user):
            return None
        run = LocalRun(instance_id, self._services.version, self._headroom.deadline_s, confirmed=False)
        self._channels.open(instance_id, user)
        self._launch(run, program, input, user, prompt)
        return run

    def _launch(self, run: LocalRun, program: str, input: dict, user: str, prompt: Prompt | None) -> None:
        self._runs[run.instance_id] = run
        run.task = asyncio.get_running_loop().create_task(self._run(run, program, input, user, prompt))
        # whatever wallet the run still holds when it ends (cancelled before it began, too) is closed
        run.task.add_done_callback(lambda _: self._close_wallet(run.instance_id, run.wallet))

    def _confirm(self, run: LocalRun) -> Channel:
        """The launcher admitted a run begun early: its ending, if it came already, goes out now."""
        run.confirmed = True
        if run.held_ending is not None:
            self._channels.emit(run.instance_id, *run.held_ending)
        return self._channels.find(run.instance_id)

    def _undo(self, run: LocalRun) -> asyncio.Task:
        """Stop a run begun early that must not go on (refused, queued, or begun with services or limits the
        launcher no longer gives): what it emitted is dropped, unseen. Its task ends once its contexts and wallet
        are cleaned up (a later run of the same id waits for that)."""
        if self._runs.get(run.instance_id) is run:
            del self._runs[run.instance_id]
        self._channels.discard(run.instance_id)
        run.task.cancel()
        return run.task

    def _end_unstarted(self, instance_id: str, admission: asyncio.Future) -> None:
        """The request went away while its admission was on its way: an instance the launcher admitted (or queued)
        anyway is ended there, so that its slot comes back."""
        if not admission.cancelled() and admission.exception() is None and isinstance(admission.result(), Admitted):
            self._launcher.ended.remote([Ending(instance_id, "error", "its client went away before it started")])

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
        """Open the instance's market wallet while the launcher admits it (the market this process knows, none
        before its first admission): a request's start then waits for one of the two calls, not both."""
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

    async def _run(self, run: LocalRun, program: str, input: dict, user: str, prompt: Prompt | None) -> None:
        instance_id = run.instance_id
        placed: str | None = None  # the replica the router chose, counted in flight there until this ends
        try:
            try:
                services = await self._current(run.services_version)
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
            ttl = (run.deadline_s or CAPABILITY_TTL_S) + CAPABILITY_MARGIN_S
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
                deadline_s=run.deadline_s,
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
            if self._runs.get(instance_id) is run:  # it ended (an undone run is no longer listed: its instance
                del self._runs[instance_id]  # runs again under the same id, and its capability must stay good)
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
            self._close_wallet(run.instance_id, wallet)
            run.wallet = wallet = None
        if wallet is None:
            return None, market
        if self._endowment is not None:
            return self._endowment, None
        self._endowment = opening = await wallet.opened()
        if opening is None:  # the market did not open it: run_inferlet tries again, and says why
            self._close_wallet(run.instance_id, wallet)
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

    async def _current(self, version: int) -> _Services:
        async with self._fetching:
            if self._services is None or self._services.version != version:
                ref = self._launcher.services_for.remote(self._node)
                services, secret, version = await answer(ref, "the launcher", LAUNCHER_S)
                endpoints = await local_endpoints(services.endpoints, services.model_files)
                relays = {name: await self._relays.address_for(name) for name in endpoints}
                endpoints, replicas = every_replica_failing_over(endpoints, services.replicas, relays)
                for name, options in replicas.items():
                    self._router.forget(name, keep=list(options))  # a replaced replica's record goes with it
                self._services = _Services(version, services, secret, endpoints, replicas)
            return self._services

    def emit(self, run: LocalRun, kind: str, value: str | bytes) -> None:
        """An event of ``run``'s: dropped when the run was undone, held when it is its ending and the launcher has
        not admitted it yet."""
        if self._runs.get(run.instance_id) is not run:
            return
        if kind in TERMINAL and not run.confirmed:
            run.held_ending = (kind, value)
            return
        self._channels.emit(run.instance_id, kind, value)

    def _replica_addresses(self, model: str) -> list[str]:
        """The model's replicas as the launcher knows them now, this node's first (what the relay tries: asked each
        time, since this process learns of a replacement only at its next admission). Runs on the relay's thread."""
        try:
            services, _, _ = ray.get(self._launcher.services_for.remote(self._node), timeout=LAUNCHER_S)
        except Exception:  # the launcher does not answer now: what this process knew
            services = self._services.services if self._services is not None else None
        if services is None or model not in services.endpoints:
            return []
        replicas = [e.address for e in services.replicas.get(model, ())]
        return list(dict.fromkeys([services.endpoints[model].address, *replicas]))

    async def _listen_for_aborts(self) -> None:
        """The launcher's aborts of instances run here (``DELETE /v1/instances/{id}``), over one long poll."""
        while True:
            try:
                polled = self._launcher.waiting_aborts.remote(self.name, 30.0)
                ids = await answer(polled, "the launcher", 30 + LAUNCHER_S)
            except (ray.exceptions.RayError, NoAnswer):
                await asyncio.sleep(1.0)
                continue
            for instance_id in ids:
                self.abort(instance_id, "aborted by its user")
