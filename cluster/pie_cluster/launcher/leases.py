"""Admission slots leased to the ingress replicas, so that a request is admitted where it lands.

An ingress replica runs the cluster's own programs (the OpenAI routes) in its own process. Rather than asking the
launcher to admit each request, it holds a *lease* per user: slots the launcher has counted as running for that user
(``Admission``), which the replica fills and empties on its own. A request whose user has a free slot in the
replica's lease starts with no call; one that finds none asks for one more (``Launcher.lease``, the asks of one
event-loop turn as one call). Slots come from the same counts and FIFO queue as every other launch, so per-user and
cluster-wide limits and the order of the queue hold across replicas; an ask that must wait keeps its place in that
queue until a slot frees (``Launcher.slot``). Nothing starts before it has its slot, so nothing is ever undone. An
ask whose request went away is withdrawn (``Launcher.withdraw``); a slot granted to it first stays in the lease, idle.

A replica gives slots back once they have been idle a while (``ingress/slot_lease.py``), and at once when the
launcher tells it launches are waiting (``RunnerOrders.reclaim``). The lease lasts as long as the replica: one whose
actor dies (Ray's ping; Serve kills a hung one) loses it, its slots go back to the counts and its instances end with
an error. A restarted launcher counts again what each replica reports it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import ray.exceptions
from pie_workers.deadlines import NoAnswer, answer

from pie_cluster.config import SupervisionConfig
from pie_cluster.hosts.events import NotFound
from pie_cluster.launcher.admission import Admission
from pie_cluster.launcher.records import Granted, Queued, Refused, RunnerOrders, RunnerReport, SlotAsk
from pie_cluster.overloaded import Overloaded

log = logging.getLogger(__name__)


@dataclass
class WaitingAsk:
    """A slot ask in the admission queue, or granted and not yet heard of by its runner (``Launcher.slot``)."""

    user: str
    granted: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # granted or withdrawn: ``slot`` answers at once


@dataclass
class Runner:
    """One ingress replica as the launcher sees it: its lease and what it is yet to be told."""

    handle: object  # its Ray actor (the Serve replica), pinged to learn that it died
    held: Counter[str] = field(default_factory=Counter)  # user -> slots counted as running for it
    idle: Counter[str] = field(default_factory=Counter)  # of those, idle at its last report
    asks: dict[str, WaitingAsk] = field(default_factory=dict)  # queued, or granted and not yet heard of
    aborts: list[str] = field(default_factory=list)
    reclaim: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # something to tell it: its long poll answers
    watch: asyncio.Task | None = None  # its pinging task, held here (the event loop keeps only weak references)
    started: int = 0  # instances it has run


class Leases:
    """The ingress replicas (runners) and their leases, granted from the launcher's ``Admission``."""

    def __init__(
        self,
        admission: Admission,
        supervision: SupervisionConfig,
        start: Callable[[str], None],
        died: Callable[[str], Awaitable[None]],
    ):
        """``start(instance_id)``: a launch that waited in the queue has its slot; ``died(name)``: called once when
        a runner's actor is gone (its lease has ended by then)."""
        self._admission, self._supervision, self._start, self._died = admission, supervision, start, died
        self._runners: dict[str, Runner] = {}
        self.services = 0  # the services' version, told to every runner

    def lease(self, runner: str, handle, asks: list[SlotAsk]) -> list[Granted | Queued | Refused]:
        holder = self._seen(runner, handle)
        answers: list[Granted | Queued | Refused] = []
        for ask in asks:
            try:
                runs_now = self._admission.admit(ask.user, ask_key(runner, ask.id))
            except Overloaded as e:
                answers.append(Refused(str(e), e.retry_after_s))
                continue
            if runs_now:
                holder.held[ask.user] += 1
                answers.append(Granted())
            else:
                holder.asks[ask.id] = WaitingAsk(ask.user)
                answers.append(Queued())
        self.reclaim_if_waiting()
        return answers

    async def slot(self, runner: str, ask_id: str, wait: float) -> bool:
        holder = self._runners.get(runner)
        waiting = holder.asks.get(ask_id) if holder is not None else None
        if waiting is None:
            raise NotFound(f"no waiting ask {ask_id!r}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiting.settled.wait(), min(max(wait, 0.0), 60.0))
        if not waiting.granted or holder.asks.get(ask_id) is not waiting:  # still waiting, or withdrawn meanwhile
            return False
        del holder.asks[ask_id]
        return True

    def withdraw(self, runner: str, ask_id: str) -> None:
        """An ask whose request went away leaves the queue, or gives back the slot granted to it; once ``slot`` has
        answered True, the slot is the runner's (it keeps it idle) and nothing is left here to withdraw."""
        holder = self._runners.get(runner)
        waiting = holder.asks.pop(ask_id, None) if holder is not None else None
        if waiting is None:
            return
        waiting.settled.set()
        if waiting.granted:
            self._give_back(holder, waiting.user, 1)
        else:
            self._admission.withdraw(waiting.user, ask_key(runner, ask_id))

    def reported(self, report: RunnerReport) -> Runner:
        """The runner of ``report``, its given-back slots freed. One this launcher did not know (it restarted since
        the runner took its slots) has them counted again."""
        new = report.runner not in self._runners
        holder = self._seen(report.runner, report.handle)
        if new:
            holder.held = Counter(report.held)
            for user, held in report.held.items():
                for _ in range(held):
                    self._admission.resume(user)
        holder.idle = Counter(report.idle)
        for user, returned in report.returned.items():
            self._give_back(holder, user, returned)
        self.reclaim_if_waiting()
        return holder

    def release(self, user: str) -> None:
        """One of ``user``'s slots is free: it goes to the first launch or ask that waits for one."""
        for key in self._admission.ended(user):
            ask = parse_ask_key(key)
            if ask is None:
                self._start(key)
                continue
            holder = self._runners[ask[0]]  # (a dead runner's asks left the queue with it)
            waiting = holder.asks[ask[1]]
            holder.held[waiting.user] += 1
            waiting.granted = True
            waiting.settled.set()

    def reclaim_if_waiting(self) -> None:
        """Launches wait for slots: every runner holding idle ones is told to give them back."""
        if not self._admission.queued:
            return
        for runner in self._runners.values():
            if runner.idle.total() > 0 and not runner.reclaim:
                runner.reclaim = True
                runner.wake.set()

    def started(self) -> dict[str, int]:
        """Instances each live runner has run (``pie status``: how the ingress replicas share the requests)."""
        return {name: runner.started for name, runner in self._runners.items()}

    def abort(self, name: str, instance_id: str) -> None:
        runner = self._runners.get(name)
        if runner is not None:  # a runner found dead has had its instances ended already
            runner.aborts.append(instance_id)
            runner.wake.set()

    def services_changed(self) -> None:
        self.services += 1
        for runner in self._runners.values():
            runner.wake.set()

    async def orders(self, name: str, wait: float) -> RunnerOrders:
        """What ``name`` is to do, waiting up to ``wait`` s for something (a long poll it keeps open)."""
        runner = self._runners.get(name)
        if runner is None:  # it has asked for nothing yet
            await asyncio.sleep(min(wait, 60.0))
            return RunnerOrders(services=self.services)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runner.wake.wait(), min(max(wait, 0.0), 60.0))
        runner.wake.clear()
        orders = RunnerOrders(tuple(runner.aborts), runner.reclaim, self.services)
        runner.aborts, runner.reclaim = [], False
        return orders

    def _seen(self, name: str, handle) -> Runner:
        runner = self._runners.get(name)
        if runner is None:
            runner = self._runners[name] = Runner(handle)
            runner.watch = asyncio.get_running_loop().create_task(self._watch(name, runner))
        return runner

    def _give_back(self, holder: Runner, user: str, slots: int) -> None:
        for _ in range(min(slots, holder.held[user])):
            holder.held[user] -= 1
            self.release(user)

    def _end_lease(self, name: str, runner: Runner) -> None:
        """A dead runner's queued asks leave the queue and its slots free."""
        del self._runners[name]
        for ask_id, waiting in runner.asks.items():
            if not waiting.granted:
                self._admission.withdraw(waiting.user, ask_key(name, ask_id))
        for user, held in runner.held.items():
            for _ in range(held):
                self.release(user)

    async def _watch(self, name: str, runner: Runner) -> None:
        """Pinged like the pooled hosts (``[supervision]``); a hung one is left to Serve's health checks."""
        while True:
            await asyncio.sleep(self._supervision.probe_every_s)
            try:
                pinged = runner.handle.__ray_ready__.remote()
                await answer(pinged, "an ingress replica", self._supervision.probe_deadline_s)
            except NoAnswer:
                continue
            except ray.exceptions.RayError:
                log.warning("ingress replica %s died: its lease ends and the instances it ran are lost", name)
                self._end_lease(name, runner)
                await self._died(name)
                return


def ask_key(runner: str, ask_id: str) -> str:
    """How an ask waits in the admission queue, beside the launches waiting there under their instance ids."""
    return f"ask/{runner}/{ask_id}"


def parse_ask_key(key: str) -> tuple[str, str] | None:
    """(runner, ask id) of a key ``ask_key`` made; None for an instance id."""
    if not key.startswith("ask/"):
        return None
    _, runner, ask_id = key.split("/", 2)
    return runner, ask_id
