"""An ingress replica's queued slot ask racing its own withdrawal in the launcher (``launcher/leases.py``): the
client went away just as a slot freed. Whichever arrives first, the slot is counted once: the runner's if
``slot`` answered True before the withdrawal, back in the launcher's hands if the withdrawal came first. (A
launcher that forgot the granted ask, and an ingress that dropped the True on its way, once left such a slot
counted as running for ever.)"""

from __future__ import annotations

import asyncio

from pie_cluster.config import SupervisionConfig
from pie_cluster.launcher.admission import Admission
from pie_cluster.launcher.leases import Leases
from pie_cluster.launcher.records import Granted, Queued, RunnerReport, SlotAsk
from pie_cluster.limits import AdmissionLimits

BOB_LIMIT = AdmissionLimits(running=8, running_per_user=1, queued=8, queued_per_user=8)


def leases() -> tuple[Leases, Admission]:
    admission = Admission(BOB_LIMIT)
    never = SupervisionConfig(probe_every_s=3600.0)  # the runner is not pinged within a test
    return Leases(admission, never, start=lambda _: None, died=lambda _: asyncio.sleep(0)), admission


async def bob_waits_for_a_second_slot(lease: Leases) -> asyncio.Task:
    """Bob's first request holds his one slot; his second waits in the queue on ``slot``."""
    assert lease.lease("ingress", None, [SlotAsk("first", "bob")]) == [Granted()]
    assert lease.lease("ingress", None, [SlotAsk("second", "bob")]) == [Queued()]
    waiting = asyncio.create_task(lease.slot("ingress", "second", 30.0))
    await asyncio.sleep(0)
    return waiting


def first_request_ends(lease: Leases) -> None:
    lease.reported(RunnerReport("ingress", "node", None, returned={"bob": 1}, held={"bob": 0}))


def test_a_withdrawal_after_the_grant_was_answered_leaves_the_slot_with_the_runner():
    async def scenario():
        lease, admission = leases()
        waiting = await bob_waits_for_a_second_slot(lease)
        first_request_ends(lease)  # the slot goes to the second ask
        assert await waiting is True
        lease.withdraw("ingress", "second")  # too late: the ingress heard True and keeps the slot, idle
        assert (admission.running, admission.queued) == (1, 0)
        lease.reported(RunnerReport("ingress", "node", None, returned={"bob": 1}))  # it gives the idle slot back
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_withdrawal_before_the_answer_gives_the_granted_slot_back_and_wakes_the_wait():
    async def scenario():
        lease, admission = leases()
        waiting = await bob_waits_for_a_second_slot(lease)
        first_request_ends(lease)  # granted, but the wait has not answered yet
        lease.withdraw("ingress", "second")
        assert await asyncio.wait_for(waiting, 1.0) is False  # at once, not after its 30 s
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_withdrawal_while_queued_leaves_the_queue_and_wakes_the_wait():
    async def scenario():
        lease, admission = leases()
        waiting = await bob_waits_for_a_second_slot(lease)
        lease.withdraw("ingress", "second")
        assert await asyncio.wait_for(waiting, 1.0) is False
        assert (admission.running, admission.queued) == (1, 0)

    asyncio.run(scenario())
