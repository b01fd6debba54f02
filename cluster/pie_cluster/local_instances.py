"""The cluster's own programs run where their request lands: in the ingress replica's process.

An OpenAI request needs no sandbox (the serving program is ours) and no node host: the ingress asks the launcher to
admit it (one call; the launcher keeps admission, listing and abort), runs the program here as an asyncio task that
talks to the replica's socket directly, and streams its events from this process's memory, so no event crosses an
actor. The launcher hears once how it ended. What the instance reaches (models, market, bus) and the secret that
mints its capability come from the launcher once per change of the cluster's services.

When a model has several replicas, each instance run here is given the one ``prefix_routing`` picks for its prompt
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
from dataclasses import dataclass, replace
from pathlib import Path

import ray
import ray.exceptions
from inferlet import runtime
from inferlet.runtime import ModelEndpoint
from pie_workers.deadlines import LAUNCHER_S, NoAnswer, answer
from pie_workers.wire import capability

from pie_cluster.coalesced_calls import CoalescedCalls
from pie_cluster.config import ChannelLimits
from pie_cluster.events import Channel, Channels
from pie_cluster.host import InstanceSetup, serve_instance
from pie_cluster.inferlet_host import CAPABILITY_MARGIN_S, CAPABILITY_TTL_S, NodeServices
from pie_cluster.model_files import local_endpoints
from pie_cluster.prefix_routing import PrefixRouter, Prompt, Routing
from pie_cluster.programs import Main, Program
from pie_cluster.replica_relay import ReplicaRelays, failing_over
from pie_cluster.wallet_calls import wallet_calls

log = logging.getLogger("pie.http")


@dataclass(frozen=True)
class _Services:
    version: int
    services: NodeServices
    secret: bytes
    endpoints: dict[str, ModelEndpoint]  # model_dir on this node
    replicas: dict[str, dict[str, ModelEndpoint]]  # model -> address -> replica (model_dir on this node)


def _failing_over(
    endpoints: dict[str, ModelEndpoint], replicas: dict[str, tuple[ModelEndpoint, ...]], relays: dict[str, str]
) -> tuple[dict[str, ModelEndpoint], dict[str, dict[str, ModelEndpoint]]]:
    """The node's endpoints, and every replica's by address (with the tokenizer files of the node's copy: they are
    the model's, whichever replica), each naming the model's other replicas and the relay to fail over to."""
    addresses = {name: [e.address for e in options] for name, options in replicas.items()}
    by_address = {
        name: {
            e.address: failing_over(replace(e, model_dir=endpoints[name].model_dir), addresses[name], relay)
            for e in replicas.get(name, ())
        }
        for name, relay in relays.items()
    }
    return {name: failing_over(e, addresses.get(name, ()), relays[name]) for name, e in endpoints.items()}, by_address


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

    def __init__(self, runner: LocalInstances, instance_id: str, channel: Channel):
        self._runner, self._id, self._channel = runner, instance_id, channel

    def send(self, text: str) -> None:
        self._runner.emit(self._id, "message", text)

    def send_file(self, data: bytes) -> None:
        self._runner.emit(self._id, "file", data)

    async def receive(self) -> str:
        return await self._channel.receive("message")

    async def receive_file(self) -> bytes:
        return await self._channel.receive("file")


class LocalInstances:
    def __init__(self, launcher, programs: dict[str, Path], routing: Routing = "prefix"):
        """``programs``: the cluster's own programs by name (the launcher's ``BUILTINS``); ``routing``: how
        requests are spread over a model's replicas (``[server] routing``)."""
        self._launcher = launcher
        self._programs = {name: Program.from_path(path) for name, path in programs.items()}
        self._mains: dict[str, Main] = {}
        self.name = uuid.uuid4().hex  # this runner, to the launcher
        self._node = ray.get_runtime_context().get_node_id()
        self._actor = ray.get_runtime_context().current_actor
        self._services: _Services | None = None
        self._fetching = asyncio.Lock()
        self._channels = Channels(ChannelLimits(keep_finished=256), ended=lambda ends: launcher.ended.remote(ends))
        self._tasks: dict[str, asyncio.Task] = {}
        self._abort_reasons: dict[str, str] = {}
        self._listening: asyncio.Task | None = None
        self._router = PrefixRouter(routing)
        self._relays = ReplicaRelays(self._replica_addresses)
        self._closing: set[asyncio.Task] = set()  # wallets being closed for instances that did not run here
        # the admissions of one event-loop turn (a burst of requests) go to the launcher as one call
        runner = (self._node, self.name, self._actor)
        self._admit = CoalescedCalls(launcher.admit_many, "the launcher", LAUNCHER_S, *runner)

    async def start(
        self, user: str, program: str, input: dict, prompt: Prompt | None = None
    ) -> tuple[str, Channel] | None:
        """Admit and start an instance of ``program`` for ``user``; its id and channel, or None when this node
        cannot run it (no view of the models here: launch it on a host). ``prompt``: its model and prompt text, to
        place it on one of the model's replicas (None: the node's default one). Raises the launcher's refusal
        (``Overloaded``)."""
        instance_id = uuid.uuid4().hex
        wallet = self._open_wallet(instance_id)
        try:
            admitted = await self._admit((instance_id, user, program, input))
        except BaseException:
            self._close_wallet(instance_id, wallet)
            raise
        if isinstance(admitted, Exception) or admitted is None or admitted["queued"]:
            self._close_wallet(instance_id, wallet)  # refused, run elsewhere, or waiting: it opens one later
            wallet = None
        if isinstance(admitted, Exception):  # refused (overloaded): this request's own answer
            raise admitted
        if admitted is None:
            return None
        if self._listening is None:  # once admitted: the launcher knows this runner from then on
            self._listening = asyncio.get_running_loop().create_task(self._listen_for_aborts())
        while admitted["queued"]:
            ref = self._launcher.admitted.remote(self.name, instance_id, LAUNCHER_S)
            admitted = await answer(ref, "the launcher", 2 * LAUNCHER_S)
        channel = self._channels.open(instance_id, user)
        if admitted["ending"] is not None:  # aborted while it waited
            channel.log.append(*admitted["ending"])
            return instance_id, channel
        work = self._run(instance_id, program, input, user, admitted, prompt, wallet)
        self._tasks[instance_id] = asyncio.get_running_loop().create_task(work)
        return instance_id, channel

    def abort(self, instance_id: str, reason: str) -> None:
        task = self._tasks.get(instance_id)
        if task is not None and not task.done():
            self._abort_reasons[instance_id] = reason
            task.cancel()

    def _open_wallet(self, instance_id: str) -> _Wallet | None:
        """Open the instance's market wallet while the launcher admits it (the market this process knows, none
        before its first admission): a request's start then waits for one of the two calls, not both."""
        market = self._services.services.market if self._services is not None else None
        if market is None:
            return None
        return _Wallet(market, asyncio.ensure_future(wallet_calls(market).join(instance_id, None)))

    def _close_wallet(self, instance_id: str, wallet: _Wallet | None) -> None:
        """Close a wallet opened for an instance that does not run here now."""
        if wallet is not None:
            task = asyncio.ensure_future(wallet.close(instance_id))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _run(
        self,
        instance_id: str,
        program: str,
        input: dict,
        user: str,
        admitted: dict,
        prompt: Prompt | None,
        wallet: _Wallet | None,
    ) -> None:
        placed: str | None = None  # the replica the router chose, counted in flight there until this ends
        try:
            try:
                services = await self._current(admitted["services"])
            except Exception as e:  # the launcher or the models' files cannot be reached
                self.emit(instance_id, "error", f"the ingress could not prepare the instance: {e}")
                return
            opening = await wallet.opened() if wallet is not None else None
            if wallet is not None and (opening is None or wallet.market != services.services.market):
                self._close_wallet(instance_id, wallet)  # the market moved meanwhile: run_inferlet opens one there
                opening, wallet = None, None
            endpoints = services.endpoints
            replicas = services.replicas.get(prompt.model, {}) if prompt is not None else {}
            if len(replicas) > 1:
                placed = self._router.choose(prompt.model, list(replicas), prompt.text, prompt.tag, prompt.follows)
                endpoints = {**endpoints, prompt.model: replicas[placed]}
            deadline_s = admitted["deadline_s"]
            ttl = (deadline_s or CAPABILITY_TTL_S) + CAPABILITY_MARGIN_S
            setup = InstanceSetup(
                instance_id=instance_id,
                username=user,
                capability=capability.mint(services.secret, user, instance_id, ttl),
                endpoints=endpoints,
                bus=services.services.bus,
                mcp_servers=services.services.mcp_servers,
                deadline_s=deadline_s,
                opening_balance=opening,
            )
            wallet = None  # from here on, run_inferlet closes it
            await serve_instance(
                self._programs[program],
                lambda: self._main(program, instance_id),
                input,
                setup,
                lambda kind, value: self.emit(instance_id, kind, value),
                _Session(self, instance_id, self._channels.find(instance_id)),
                aborted=lambda: self._abort_reasons.pop(instance_id, "aborted"),
                market=services.services.market,
            )
        finally:
            self._close_wallet(instance_id, wallet)  # (None once run_inferlet has it)
            self._tasks.pop(instance_id, None)
            if placed is not None:
                self._router.finished(prompt.model, placed)

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
                endpoints, replicas = _failing_over(endpoints, services.replicas, relays)
                for name, options in replicas.items():
                    self._router.forget(name, keep=list(options))  # a replaced replica's record goes with it
                self._services = _Services(version, services, secret, endpoints, replicas)
            return self._services

    def emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        self._channels.emit(instance_id, kind, value)

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
