"""A model's link to its replica that survives the replica: when the connection breaks, the link moves to another
replica of the model, recomputes the inferlet's contexts there from their lineage (``inferlet._lineage``), and
sends again the calls that had no answer, in the order they were first sent. The inferlet sees its calls answered
later, with the results the dead replica would have given (greedy decoding: the same tokens).

Where it may go is the endpoint's ``failover`` list: the model's other replicas, then the host's relay to whichever
replica of the model serves (the dead one's replacement). A context that cannot be recomputed (KV written under a
custom attention mask, an adapter or a zo seed) is lost with its replica: every later call on it raises
``ContextLost``. So is every call when no replica answers within ``FAILOVER_S``.

Awaited calls wait for the move without holding the event loop. A blocking call that finds the replica gone moves
the link itself, blocking, and takes over a move already under way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pie_workers.wire.messages import ContextReply, decode

from inferlet import runtime
from inferlet._channel import Channel, ReplicaError, ReplicaLost

if TYPE_CHECKING:
    from inferlet.context import Context

log = logging.getLogger(__name__)

FAILOVER_S = 120.0  # how long a link looks for a replica that answers before its calls fail
RETRY_S = 0.25  # pause after trying every failover address in turn


class ContextLost(ReplicaError):
    """The context's replica died and the context could not be recomputed elsewhere."""


@dataclass
class _Call:
    """An awaited call: ``args`` are values, or callables read each time it is sent (a context's id changes when
    it is recomputed elsewhere); ``noted`` sees its answer before the caller does."""

    future: asyncio.Future
    op: str
    args: tuple
    noted: Callable[[Any], None] | None


class ReplicaLink:
    """One inferlet's calls to one model: the replica it reaches now, and where to go if that one dies."""

    def __init__(self, model: str, address: str, failover: tuple[str, ...], session: str):
        self.model = model
        self.failover = failover
        self.session = session
        self.channel = Channel(address, session)
        self.contexts: dict[Context, None] = {}  # its live contexts, in creation order (the ones to recompute)
        self.moves = 0  # how many times it moved to another replica
        self.resent = 0  # calls that had no answer from a dead replica and were sent again after a move
        self._moving: asyncio.Task | None = None
        self._waiting: list[_Call] = []

    @property
    def moving(self) -> bool:
        """Whether it is moving to another replica now (the contexts on the old one are gone)."""
        return self._moving is not None

    @property
    def mirrors(self) -> bool:
        """Whether contexts keep the lineage a move would recompute them from."""
        return bool(self.failover)

    # -- calls ---------------------------------------------------------------------------------------------------

    def call(self, op: str, *args: Any, noted: Callable[[Any], None] | None = None) -> asyncio.Future:
        """Send ``op`` in this loop iteration's frame; the future is answered by whichever replica runs it."""
        call = _Call(asyncio.get_running_loop().create_future(), op, args, noted)
        self._send(call)
        return call.future

    def call_sync(self, op: str, *args: Any) -> Any:
        """A blocking call; if the replica is gone, moves the link first (blocking too) and sends it there."""
        if self._moving is None:
            try:
                return self.channel.call_sync(op, *_resolved(args))
            except ReplicaLost:
                if not self.failover:
                    raise
        self._move_now()
        return self.channel.call_sync(op, *_resolved(args))

    def _send(self, call: _Call) -> None:
        if self._moving is not None:
            self._waiting.append(call)
            return
        try:
            args = _resolved(call.args)
        except Exception as e:  # its context was lost
            call.future.set_exception(e)
            return
        moves = self.moves
        self.channel.call(call.op, *args).add_done_callback(lambda sent: self._answered(call, sent, moves))

    def _answered(self, call: _Call, sent: asyncio.Future, moves: int) -> None:
        if call.future.done():  # the caller gave up on it
            return
        if sent.cancelled():
            call.future.cancel()
            return
        error = sent.exception()
        if isinstance(error, ReplicaLost) and self.failover:
            if self._moving is None and moves == self.moves:
                self._moving = asyncio.get_running_loop().create_task(self._move())
            self.resent += 1
            self._send(call)  # waits for the move, or goes to where it led
            return
        if error is None:
            try:
                if call.noted is not None:
                    call.noted(sent.result())
            except Exception as e:
                error = e
            else:
                call.future.set_result(sent.result())
                return
        call.future.set_exception(error)

    # -- moving to another replica -------------------------------------------------------------------------------

    async def _move(self) -> None:
        """Recompute every context on the first failover address that answers; then send what waited."""
        deadline = time.monotonic() + FAILOVER_S
        try:
            for address in self._addresses(deadline):
                channel = Channel(address, self.session)
                try:
                    for ctx, lineage in self._restorable():
                        try:
                            made = await channel.call("restore", *lineage)
                        except ReplicaLost:
                            raise
                        except Exception as e:  # refused by the replica: this context alone is lost
                            ctx.lose(f"its replica died and another could not recompute it: {e}")
                            continue
                        ctx.moved(decode(ContextReply, made).ctx)
                except ReplicaLost:
                    channel.close()
                    await asyncio.sleep(0 if address != self.failover[-1] else RETRY_S)
                    continue
                self._moved_to(channel)
                break
            else:
                self._give_up()
        except asyncio.CancelledError:  # a blocking call took the move over
            return
        except Exception:  # a bug here must not leave every later call waiting for a move that never ends
            log.exception("moving to another replica of model %r failed", self.model)
            self._give_up()
        self._moving = None
        self._send_waiting()

    def _move_now(self) -> None:
        """``_move``, blocking (a blocking call found the replica gone): takes over a move under way. The process's
        stall watchdog, if it has one, is told this wait is the cluster's (``runtime.blocking_wait``)."""
        if self._moving is not None:
            self._moving.cancel()
            self._moving = None
        with runtime.blocking_wait():
            self._move_blocking()
        self._send_waiting()

    def _move_blocking(self) -> None:
        for address in self._addresses(time.monotonic() + FAILOVER_S):
            channel = Channel(address, self.session)
            try:
                for ctx, lineage in self._restorable():
                    try:
                        made = channel.call_sync("restore", *lineage)
                    except ReplicaLost:
                        raise
                    except Exception as e:
                        ctx.lose(f"its replica died and another could not recompute it: {e}")
                        continue
                    ctx.moved(decode(ContextReply, made).ctx)
            except ReplicaLost:
                channel.close()
                if address == self.failover[-1]:
                    time.sleep(RETRY_S)
                continue
            self._moved_to(channel)
            break
        else:
            self._give_up()

    def _send_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for call in waiting:
            self._send(call)

    def _addresses(self, deadline: float) -> Iterator[str]:
        """The failover addresses in turn, round and round, until ``deadline``."""
        for address in itertools.cycle(self.failover):
            if time.monotonic() > deadline:
                return
            yield address

    def _restorable(self) -> Iterator[tuple[Context, tuple]]:
        """Each live context that can be recomputed, with the ``restore`` arguments that do it; the others lost."""
        for ctx in list(self.contexts):
            lineage = ctx.lineage
            if lineage.lost:
                ctx.lose(f"its replica died, and {lineage.lost}")
            else:
                yield ctx, (lineage.tokens, lineage.positions, lineage.sampled, ctx.bid, lineage.cache_salt)

    def _moved_to(self, channel: Channel) -> None:
        self.channel.close()
        self.channel = channel
        self.moves += 1

    def _give_up(self) -> None:
        why = f"its replica died and no replica of model {self.model!r} answered within {FAILOVER_S:.0f} s"
        for ctx in list(self.contexts):
            ctx.lose(why)
        self.failover = ()  # what waits fails now, as calls on a dead replica do
        self.moves += 1

    def close(self) -> None:
        """Release this inferlet's contexts on the replica and hang up. Where the link could move, a replica that
        died took the contexts with it and there is nothing to report; elsewhere its loss raises."""
        try:
            if self._moving is not None:
                self._moving.cancel()
            self.channel.call_sync("close")
        except ReplicaLost:
            if not self.failover:
                raise
        finally:
            self.channel.close()

    async def aclose(self) -> None:
        """``close`` without holding the event loop: the replica's answer (after it released the contexts and
        settled their pages with the market) can take a forward pass and a market round, and the inferlets sharing
        this process's loop go on meanwhile. The request is on its way once sent, so a cancelled wait still
        releases."""
        try:
            if self._moving is not None:
                self._moving.cancel()
            await self.channel.call("close")
        except ReplicaLost:
            if not self.failover:
                raise
        finally:
            self.channel.close()


def _resolved(args: tuple) -> list:
    return [a() if callable(a) else a for a in args]
