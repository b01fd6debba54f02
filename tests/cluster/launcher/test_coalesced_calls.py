"""Calls made in one event-loop turn reach a real actor as one batch call; each caller gets its own answer, and a
batch that fails fails every caller in it."""

from __future__ import annotations

import asyncio

from pie_cluster.coalesced_calls import CoalescedCalls


def _doubler(ray):
    """An actor with a batch method that counts its calls (defined here: the workers do not import the tests)."""

    class Doubler:
        def __init__(self) -> None:
            self.batches: list[int] = []

        async def double_many(self, numbers: list[int]) -> list[int]:
            self.batches.append(len(numbers))
            if any(n < 0 for n in numbers):
                raise ValueError("no negative numbers")
            return [2 * n for n in numbers]

        async def sizes(self) -> list[int]:
            return self.batches

    return ray.remote(Doubler).remote()


def test_calls_of_one_loop_turn_are_one_batch_and_answer_in_order(ray_session):
    doubler = _doubler(ray_session)

    async def run() -> tuple[list[int], list[int]]:
        double = CoalescedCalls(doubler.double_many, "the doubler", 30.0)
        together = await asyncio.gather(*(double(n) for n in range(10)))
        alone = [await double(n) for n in (20, 21)]
        return together, alone

    together, alone = asyncio.run(run())
    assert together == [2 * n for n in range(10)] and alone == [40, 42]
    assert ray_session.get(doubler.sizes.remote()) == [10, 1, 1]


def test_a_failing_batch_fails_each_of_its_callers(ray_session):
    doubler = _doubler(ray_session)

    async def run() -> list:
        double = CoalescedCalls(doubler.double_many, "the doubler", 30.0)
        return await asyncio.gather(double(1), double(-1), return_exceptions=True)

    outcomes = asyncio.run(run())
    assert len(outcomes) == 2 and all(isinstance(o, Exception) and "no negative" in str(o) for o in outcomes)
