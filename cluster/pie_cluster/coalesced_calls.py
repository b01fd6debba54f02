"""Calls to one actor method made in the same event-loop turn, sent as one call of its batch form.

Submitting a Ray actor call costs the caller about a millisecond of CPU, whatever it carries; the ingress's
Responses turns finish in bursts (agents decoding in the same batch end their turns in the same step), so their
store writes coalesce into one call per burst instead of one per turn. Each caller still awaits its own answer.
A batch is made for all its callers, so it is no one request's (``remote_outside_requests``).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from pie_workers.deadlines import answer


class CoalescedCalls:
    def __init__(self, method, part: str, deadline_s: float, *leading: Any):
        """``method``: an actor method taking a list of arguments (after ``leading``, the same for every batch) and
        answering a list of results, in order; ``part`` and ``deadline_s``: as for ``answer``, per batch."""
        self._method, self._part, self._deadline_s, self._leading = method, part, deadline_s, leading
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._answering: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks

    async def __call__(self, argument: Any) -> Any:
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._send)
        future = loop.create_future()
        self._pending.append((argument, future))
        return await future

    def _send(self) -> None:
        batch, self._pending = self._pending, []
        ref = remote_outside_requests(self._method, *self._leading, [argument for argument, _ in batch])
        task = asyncio.get_running_loop().create_task(self._answer(ref, [future for _, future in batch]))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, ref, futures: list[asyncio.Future]) -> None:
        try:
            results = await answer(ref, self._part, self._deadline_s)
        except Exception as e:  # every caller of the batch hears it
            for future in futures:
                if not future.done():
                    future.set_exception(e)
            return
        for future, result in zip(futures, results, strict=True):
            if not future.done():
                future.set_result(result)


def remote_outside_requests(method, *args: Any):
    """``method.remote(*args)`` made for this process, not for the request being served. Ray takes a call made in a
    Serve request's context (its contextvars) for a child of that request and cancels it with the request, as Serve
    does when the client goes away: the call may then never run, or run with its answer lost. A call that others
    count on (a batch of several requests' calls, a lease's notices to the launcher) must reach its actor anyway."""
    return contextvars.Context().run(method.remote, *args)
