"""This ingress replica's lease of admission slots, per user, and its reports to the launcher.

The launcher leases each ingress replica admission slots per user (``launcher/leases.py``). A request takes a free
slot of its user's here and starts, with no call; one that finds none asks the launcher for one more (the asks of
one event-loop turn as one call) and, when the user or the cluster is at a limit, waits in the launcher's queue for
it. A slot that an instance frees stays here for the user's next request; it goes back once it has been idle
``IDLE_S``, or at once when the launcher says launches wait for slots (``give_back_idle``). The instances begun
here, how they ended and the slots given back go to the launcher as one report per event-loop turn that has news,
and at least every ``RENEW_S`` while the replica holds slots.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from pie_workers.deadlines import LAUNCHER_S, NoAnswer, answer
from ray.exceptions import RayActorError

from pie_cluster.coalesced_calls import CoalescedCalls, remote_outside_requests
from pie_cluster.hosts.events import Ending, NotFound
from pie_cluster.instance import Launch
from pie_cluster.launcher.records import Granted, Queued, Refused, RunnerReport, RunOnHost, SlotAsk

IDLE_S = 2.0
"""How long a freed slot waits here for its user's next request before it goes back to the launcher."""
RENEW_S = 5.0
"""The longest a replica holding slots stays silent: what it reports renews its lease (and a restarted launcher
learns from it what the replica holds)."""
TICK_S = 0.5
REQUEUE_S = 120.0
"""How long a request that waited in the launcher's queue when the launcher died asks the restarted one again."""


@dataclass
class _UserSlots:
    held: int = 0
    idle_since: list[float] = field(default_factory=list)  # one per idle slot, oldest first


class SlotLease:
    def __init__(self, launcher, node: str, name: str, actor):
        """``name``: this replica, to the launcher; ``actor``: its Ray actor, which the launcher pings."""
        self._launcher, self._node, self._name, self._actor = launcher, node, name, actor
        self._users: dict[str, _UserSlots] = {}
        self._ask = CoalescedCalls(launcher.lease, "the launcher", LAUNCHER_S, node, name, actor)
        self._started: list[Launch] = []
        self._ended: list[Ending] = []
        self._returned: Counter[str] = Counter()
        self._flushing = False
        self._reported = time.monotonic()
        self._ticking: asyncio.Task | None = None

    async def acquire(self, user: str) -> bool:
        """A slot for a request of ``user``'s: True once it has one; False when this replica's node cannot run the
        cluster's programs (launch it on an inferlet host). Raises the launcher's refusal (``Overloaded``)."""
        slots = self._users.get(user)
        if slots is not None and slots.idle_since:
            slots.idle_since.pop()  # the one freed last: the older ones age out
            return True
        ask = SlotAsk(uuid.uuid4().hex, user)
        queue_lost: float | None = None  # when the launcher died with this ask in its queue
        while True:
            try:
                answered = await self._asked(ask)
            except RayActorError:  # the launcher is down: a request that had its place in its queue waits for it
                if queue_lost is None or time.monotonic() - queue_lost > REQUEUE_S:
                    raise
                await asyncio.sleep(TICK_S)
                continue
            if isinstance(answered, RunOnHost):
                return False
            if isinstance(answered, Refused):
                raise answered.error()
            if isinstance(answered, Granted) or await self._waited(ask):
                break
            if queue_lost is not None and time.monotonic() - queue_lost > REQUEUE_S:
                raise NoAnswer(f"the launcher lost this request's place in its queue again for {REQUEUE_S:g} s")
            queue_lost = queue_lost or time.monotonic()
        self._users.setdefault(user, _UserSlots()).held += 1
        self._tick()
        return True

    async def _asked(self, ask: SlotAsk):
        """The launcher's answer to ``ask`` (one ``lease`` call with the other asks of this loop turn)."""
        asking = asyncio.ensure_future(self._ask(ask))
        try:
            return await asyncio.shield(asking)
        except BaseException:  # the request went away (or no answer came): whatever the answer is, it is handled
            asking.add_done_callback(lambda done: self._answered_late(ask, done))
            raise

    async def _waited(self, ask: SlotAsk) -> bool:
        """Wait in the launcher's queue until the slot of ``ask`` is granted (True). False when the launcher died
        meanwhile: its queue went with it, so the ask goes again, to the restarted one (after this replica's report,
        so that it counts the slots held here first). A request that goes away meanwhile withdraws its ask; the
        launcher may have granted its slot just before, so the answer on its way is still heard (``_granted_late``)."""
        while True:
            slot = remote_outside_requests(self._launcher.slot, self._name, ask.id, LAUNCHER_S)
            granting = asyncio.ensure_future(answer(slot, "the launcher", 2 * LAUNCHER_S))
            try:
                if await asyncio.shield(granting):
                    return True
            except (RayActorError, NotFound):  # it died, or it restarted and knows no such ask
                self._soon()  # submitted before the ask goes again
                return False
            except BaseException:  # the request went away (or no answer came)
                remote_outside_requests(self._launcher.withdraw, self._name, ask.id)
                granting.add_done_callback(lambda done: self._granted_late(ask, done))
                raise

    def _granted_late(self, ask: SlotAsk, done: asyncio.Future) -> None:
        """The launcher's last ``slot`` answer to an ask whose request went away: True when it granted the slot
        before the withdrawal arrived, which then stays here, idle."""
        if not done.cancelled() and done.exception() is None and done.result():
            self._keep_idle(ask.user)

    def _answered_late(self, ask: SlotAsk, done: asyncio.Future) -> None:
        """An ask whose request went away before its answer: a slot granted anyway stays here, idle; a place in
        the queue is withdrawn."""
        if done.cancelled() or done.exception() is not None:
            return
        if isinstance(done.result(), Granted):
            self._keep_idle(ask.user)
        elif isinstance(done.result(), Queued):
            remote_outside_requests(self._launcher.withdraw, self._name, ask.id)

    def _keep_idle(self, user: str) -> None:
        """A slot granted to a request that went away: idle here, for the user's next request or to age out."""
        self._users.setdefault(user, _UserSlots()).held += 1
        self.free(user)
        self._tick()

    def free(self, user: str) -> None:
        """An instance of ``user``'s that held a slot ended."""
        self._users[user].idle_since.append(time.monotonic())

    def started(self, launch: Launch) -> None:
        self._started.append(launch)
        self._soon()

    def ended(self, endings: list[Ending]) -> None:
        self._ended.extend(endings)
        self._soon()

    def give_back_idle(self, idle_for: float = 0.0) -> None:
        """Slots idle at least ``idle_for`` s go back to the launcher (0: every idle one)."""
        now = time.monotonic()
        for user, slots in list(self._users.items()):
            back = sum(1 for since in slots.idle_since if now - since >= idle_for)
            if back:
                del slots.idle_since[:back]
                slots.held -= back
                self._returned[user] += back
            if slots.held == 0:
                del self._users[user]
        if self._returned:
            self._soon()

    def _soon(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._flushing = False
        held = {user: slots.held for user, slots in self._users.items()}
        idle = {user: len(slots.idle_since) for user, slots in self._users.items() if slots.idle_since}
        report = RunnerReport(
            self._name,
            self._node,
            self._actor,
            tuple(self._started),
            tuple(self._ended),
            dict(self._returned),
            held,
            idle,
        )
        self._started, self._ended, self._returned = [], [], Counter()
        remote_outside_requests(self._launcher.report, report)
        self._reported = time.monotonic()

    def _tick(self) -> None:
        if self._ticking is None:
            self._ticking = asyncio.get_running_loop().create_task(self._ticker())

    async def _ticker(self) -> None:
        """Ages idle slots out, and renews the lease while it holds any."""
        while True:
            await asyncio.sleep(TICK_S)
            self.give_back_idle(IDLE_S)
            if self._users and time.monotonic() - self._reported >= RENEW_S:
                self._soon()
