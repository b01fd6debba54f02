"""Collects forward requests from every inferlet on a replica into ragged batches (continuous batching).

One batch runs at a time. While it runs, new requests queue up; when it finishes, the next batch fires as soon as
the queue holds as many requests as recent batches did (so N inferlets stepping in lock-step stay in one batch) or
as there are contexts to make them, or after a short wait bounded by the last batch's latency (so a lone request is
never held long). Batches respect limits on tokens, requests and page references; page copies (forks) and moves to
and from host memory ride with the next batch, in the order they were submitted.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pie_workers.wire.batch import ForwardBatch, ForwardRequest, RequestOutput


@dataclass(frozen=True)
class BatchLimits:
    max_tokens: int = 2048  # also the prefill chunk size: longer inputs are split by the engine
    max_requests: int = 256
    max_page_refs: int = 65536
    max_wait_s: float = 0.005  # upper bound on holding a batch open for stragglers


def prefill_chunks(rows: int, limit: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` row ranges a prefill of ``rows`` runs as, each of at most ``limit`` rows (the batch's
    token limit): a pass's leading chunks, and a restored context's recomputation."""
    return [(start, min(start + limit, rows)) for start in range(0, rows, limit)]


@dataclass(slots=True)
class _Job:
    request: ForwardRequest | None  # None: a job that only moves pages
    then: Callable[[RequestOutput | Exception | None], None]  # called with the result the moment the batch ends
    copies: Sequence[tuple[int, int]] = ()
    offloads: Sequence[tuple[int, int]] = ()
    restores: Sequence[tuple[int, int]] = ()


class BatchScheduler:
    def __init__(
        self,
        execute: Callable[[ForwardBatch], Awaitable[list[RequestOutput]]],
        limits: BatchLimits,
        contexts: Callable[[], int] = lambda: 1 << 30,
    ):
        """``contexts``: how many contexts there are; each has at most one request in a batch, so after a burst
        of many a batch waits for no more stragglers than there are contexts left."""
        self._execute = execute
        self.limits = limits
        self._contexts = contexts
        self._queue: deque[_Job] = deque()
        self._arrived = asyncio.Event()
        self._recent_sizes: deque[int] = deque(maxlen=8)
        self.last_latency_s = 0.0
        self.batches_fired = 0
        self.requests_served = 0

    @property
    def queued(self) -> int:
        """Forward requests waiting for the next batch."""
        return len(self._queue)

    def submit(
        self,
        request: ForwardRequest | None,
        copies: list[tuple[int, int]] = (),
        offloads: list[tuple[int, int]] = (),
        restores: list[tuple[int, int]] = (),
    ) -> asyncio.Future:
        """Queue one request and/or page moves; the future resolves to its RequestOutput (None without a request).
        Moves run in submission order: pages offloaded here are safe to reuse in any later job."""
        future = asyncio.get_running_loop().create_future()

        def resolve(result: RequestOutput | Exception | None) -> None:
            if future.done():  # its awaiter was cancelled
                return
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

        self._queue.append(_Job(request, resolve, list(copies), list(offloads), list(restores)))
        self._arrived.set()
        return future

    def submit_then(self, request: ForwardRequest, then: Callable[[RequestOutput | Exception], None]) -> None:
        """Queue a request whose batch calls ``then`` with its RequestOutput (or the batch's failure) the moment
        it ends, before the event loop reads anything else: the engine's fast path settles a pass there, so the
        next step's request, already waiting in the socket, finds its context free."""
        self._queue.append(_Job(request, then))
        self._arrived.set()

    def withdraw(self, pages: set[int], error: Exception) -> None:
        """Fail the queued requests that write to any of ``pages`` (a destroyed context's working pages, back in
        the pool): one still queued could otherwise share a batch with the next owner of a page, both writing it.
        A batch already taken runs before any later request can use the pages."""
        hit = [j.request is not None and not pages.isdisjoint(j.request.page_ids) for j in self._queue]
        if not any(hit):
            return
        withdrawn = [j for j, h in zip(self._queue, hit, strict=True) if h]
        self._queue = deque(j for j, h in zip(self._queue, hit, strict=True) if not h)
        for job in withdrawn:  # after the queue is settled: a callback may queue new requests
            job.then(error)

    async def run(self) -> None:
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._gather_stragglers()
            jobs = self._take()
            batch = ForwardBatch(
                [j.request for j in jobs if j.request is not None],
                [c for j in jobs for c in j.copies],
                [o for j in jobs for o in j.offloads],
                [r for j in jobs for r in j.restores],
            )
            start = time.perf_counter()
            try:
                outputs = await self._execute(batch)
            except Exception as e:  # a runner failure fails this batch's requests, not the replica
                failure = RuntimeError(f"forward pass failed: {e}")
                for j in jobs:
                    j.then(failure)
                continue
            self.last_latency_s = time.perf_counter() - start
            self._recent_sizes.append(len(batch.requests))
            self.batches_fired += 1
            self.requests_served += len(batch.requests)
            results = iter(outputs)
            for j in jobs:
                j.then(next(results) if j.request is not None else None)

    async def _gather_stragglers(self) -> None:
        """Hold the batch open briefly while fewer requests are queued than recent batches carried."""
        target = min(max(self._recent_sizes, default=1), self._contexts())
        deadline = time.perf_counter() + min(self.limits.max_wait_s, self.last_latency_s)
        while len(self._queue) < target and time.perf_counter() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - time.perf_counter())
            except TimeoutError:
                break

    def _take(self) -> list[_Job]:
        jobs, tokens, refs = [], 0, 0
        while self._queue and len(jobs) < self.limits.max_requests:
            job = self._queue[0]
            req = job.request
            n = len(req.token_ids) + len(req.draft_tokens) if req else 0
            p = len(req.page_ids) if req else 0
            if jobs and (tokens + n > self.limits.max_tokens or refs + p > self.limits.max_page_refs):
                break
            jobs.append(self._queue.popleft())
            tokens, refs = tokens + n, refs + p
        return jobs
