"""How long one part of the cluster waits for another's answer, in one place.

Every remote call between parts of the cluster has a deadline, so a part that hangs (stopped, deadlocked, its node
cut off) shows up as an error naming it, never as a caller hung with it. They live in the workers package because
both sides use them: replicas call the user directory, and the cluster imports the workers, never the reverse.
"""

from __future__ import annotations

import asyncio

LAUNCHER_S = 30.0  # the launcher: a route of the HTTP app, a Ray job, the controller (beyond a long poll's wait)
MARKET_S = 10.0  # the market: an instance's wallet opened or closed
DIRECTORY_S = 30.0  # the user directory: a snapshot's lineage, an adapter's weights
CONTROLLER_S = 300.0  # the controller: `pie status` (which itself waits up to a probe deadline for each part)
HOST_S = 30.0  # an inferlet host: taking an instance, an abort, a change of services
BUS_S = 60.0  # a bus shard: started (a process to make), stopped, asked where it listens
RESPONSE_STORE_S = 10.0  # the Responses API's record store: a record read, written or removed
DEDICATED_START_S = 600.0  # a dedicated host made for one instance: started, its runtime_env installed, ready


class NoAnswer(TimeoutError):
    """A part of the cluster did not answer within its deadline (its one argument, the message, lets Ray carry it
    across processes)."""

    @classmethod
    def of(cls, part: str, deadline_s: float) -> NoAnswer:
        return cls(f"{part} did not answer within {deadline_s:g} s")


async def answer(ref, part: str, deadline_s: float):
    """The result of the remote call ``ref``, or ``NoAnswer`` naming ``part`` once ``deadline_s`` has passed."""
    try:
        return await asyncio.wait_for(ref, deadline_s)
    except TimeoutError:
        raise NoAnswer.of(part, deadline_s) from None


def answered(ref, part: str, deadline_s: float):
    """``answer`` for callers outside an event loop."""
    import ray  # here, not above: sandboxed workers import ``answer`` (through the host module) and have no Ray

    try:
        return ray.get(ref, timeout=deadline_s)
    except ray.exceptions.GetTimeoutError:
        raise NoAnswer.of(part, deadline_s) from None
