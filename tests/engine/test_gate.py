"""The engine's per-context gate: one holder at a time, first come first served, callbacks and awaiting takers in
one line, and a cancelled waiter never keeps the gate nor loses a handover."""

from __future__ import annotations

import asyncio

import pytest
from pie_workers.engine.gate import Gate


def run(coro):
    return asyncio.run(coro)


def test_taken_synchronously_only_when_free():
    gate = Gate()
    assert gate.take_now() and gate.locked()
    assert not gate.take_now()
    gate.give()
    assert not gate.locked() and gate.take_now()


def test_waiters_of_both_kinds_are_served_in_arrival_order():
    async def scenario():
        gate, order = Gate(), []
        gate.take_now()

        async def awaiting(name):
            async with gate:
                order.append(name)
                await asyncio.sleep(0)

        first = asyncio.create_task(awaiting("task 1"))
        await asyncio.sleep(0)  # queued behind the holder
        gate.when_free(lambda: (order.append("callback"), gate.give()))
        second = asyncio.create_task(awaiting("task 2"))
        await asyncio.sleep(0)
        assert order == []  # nobody runs while the holder has it
        gate.give()
        await asyncio.gather(first, second)
        assert order == ["task 1", "callback", "task 2"]
        assert not gate.locked()

    run(scenario())


def test_a_handed_gate_cannot_be_taken_by_someone_who_came_later():
    async def scenario():
        gate = Gate()
        gate.take_now()
        waiter = asyncio.create_task(gate.take())
        await asyncio.sleep(0)
        gate.give()  # handed to the waiter, which has not run yet
        assert gate.locked() and not gate.take_now()
        started = []
        gate.when_free(lambda: started.append(True))  # queued, not run
        assert not started
        await waiter
        gate.give()
        assert started == [True] and gate.locked()  # the callback now holds it

    run(scenario())


def test_a_callback_runs_at_once_on_a_free_gate_and_holds_it():
    gate, ran = Gate(), []
    gate.when_free(lambda: ran.append(gate.locked()))
    assert ran == [True] and gate.locked()


@pytest.mark.parametrize("handed_over", [False, True])
def test_a_cancelled_waiter_leaves_the_line_and_passes_on_a_handover(handed_over):
    async def scenario():
        gate = Gate()
        gate.take_now()
        cancelled = asyncio.create_task(gate.take())
        await asyncio.sleep(0)
        later = asyncio.create_task(gate.take())
        await asyncio.sleep(0)
        if handed_over:
            gate.give()  # the gate is the cancelled waiter's now; its cancellation must pass it on
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        if not handed_over:
            gate.give()
        await asyncio.wait_for(later, 1)
        assert gate.locked()
        gate.give()
        assert not gate.locked()

    run(scenario())
