"""The batch scheduler's adaptive firing: a batch waits for stragglers only while more requests can still come."""

from __future__ import annotations

import asyncio

from pie_workers.engine.scheduler import BatchLimits, BatchScheduler
from pie_workers.wire.batch import ForwardBatch, ForwardRequest


def _request() -> ForwardRequest:
    return ForwardRequest([1], [0], [0], 0, [])


def _batches(contexts: int) -> list[int]:
    """A batch of three (0.2 s long, which bounds the wait for stragglers after it), then one request, and another
    a few event-loop turns later: the sizes of the batches that ran."""

    async def main() -> list[int]:
        sizes: list[int] = []

        async def execute(batch: ForwardBatch):
            sizes.append(len(batch.requests))
            if len(sizes) == 1:
                await asyncio.sleep(0.2)
            return [None] * len(batch.requests)

        scheduler = BatchScheduler(execute, BatchLimits(max_wait_s=1.0), contexts=lambda: contexts)
        running = asyncio.get_running_loop().create_task(scheduler.run())
        try:
            await asyncio.gather(*(scheduler.submit(_request()) for _ in range(3)))
            first = scheduler.submit(_request())
            for _ in range(5):
                await asyncio.sleep(0)
            await asyncio.gather(first, scheduler.submit(_request()))
        finally:
            running.cancel()
        return sizes

    return asyncio.run(main())


def test_after_a_burst_a_lone_context_waits_for_nobody():
    assert _batches(contexts=1) == [3, 1, 1]


def test_a_batch_waits_for_stragglers_while_contexts_could_send_them():
    assert _batches(contexts=3) == [3, 2]
