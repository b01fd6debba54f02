"""A model's link to its replica that survives the replica: when the connection breaks, the link moves to another
replica of the model, recomputes the inferlet's contexts there from their lineage (``inferlet._lineage``), and
sends again the calls that had no answer, in the order they were first sent. The inferlet sees its calls answered
later, with the results the dead replica would have given (greedy decoding: the same tokens).

Where it may go is the endpoint's ``failover`` list: the model's other replicas, then the host's relay to whichever
replica of the model serves (the dead one's replacement). A context that cannot be recomputed (KV written under a
custom attention mask, an adapter or a zo seed) is lost with its replica: every later call on it raises
``ContextLost``. So is every call when no replica answers within ``FAILOVER_S``.

A replica that leaves while it still answers (scaled down, drained) hands its contexts to another replica with
their KV pages first, and answers every call ``ReplicaMoved``, naming that replica: the link goes there first and
``claim``s its contexts by their old ids, so nothing is recomputed (``transferred`` counts them); a context that is
not there (the handover refused it, or the link ended up elsewhere) is recomputed as after a death. A link without
failover addresses follows such a notice too, and then even a context it keeps no lineage for moves.

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

from pie_workers.wire.messages import Claim, ContextReply, MovedNotice, decode, encode

from inferlet import runtime
from inferlet._channel import Channel, ReplicaError, ReplicaLost, ReplicaMoved

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
        self.transferred = 0  # contexts taken up with their KV from a replica that left (not recomputed)
        self._notice: MovedNotice | None = None  # where the replica that left put its contexts (this move's)
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
            except ReplicaLost as e:
                if not self._can_move(e):
                    raise
        self._move_now()
        return self.channel.call_sync(op, *_resolved(args))

    def _can_move(self, error: ReplicaLost) -> bool:
        """Whether the link can move away from the replica ``error`` came from (noting where a replica that left
        put its contexts)."""
        self._notice = error.notice if isinstance(error, ReplicaMoved) else None
        return bool(self.failover) or self._notice is not None

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
        if isinstance(error, ReplicaLost) and (self.failover or isinstance(error, ReplicaMoved)):
            if self._moving is None and moves == self.moves:
                self._can_move(error)
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
        """Take every context up on the first address that answers (claimed there with its KV if the replica that
        left handed it over, else recomputed); then send what waited."""
        deadline = time.monotonic() + FAILOVER_S
        try:
            for address, last in self._addresses(deadline):
                channel = Channel(address, self.session)
                try:
                    try:
                        claimed = await channel.call("claim", self._claims()) if self.contexts else []
                    except ReplicaLost:
                        raise
                    except Exception:  # a replica that takes no claims: every context is recomputed
                        claimed = None
                    for ctx, lineage in self._restorable(claimed):
                        try:
                            made = await channel.call("restore", *lineage)
                        except ReplicaLost:
                            raise
                        except Exception as e:  # refused by the replica: this context alone is lost
                            ctx.lose(f"its replica {self._went} and another could not recompute it: {e}")
                            continue
                        ctx.moved(decode(ContextReply, made).ctx)
                except ReplicaLost:
                    channel.close()
                    await asyncio.sleep(RETRY_S if last else 0)
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
        for address, last in self._addresses(time.monotonic() + FAILOVER_S):
            channel = Channel(address, self.session)
            try:
                try:
                    claimed = channel.call_sync("claim", self._claims()) if self.contexts else []
                except ReplicaLost:
                    raise
                except Exception:
                    claimed = None
                for ctx, lineage in self._restorable(claimed):
                    try:
                        made = channel.call_sync("restore", *lineage)
                    except ReplicaLost:
                        raise
                    except Exception as e:
                        ctx.lose(f"its replica {self._went} and another could not recompute it: {e}")
                        continue
                    ctx.moved(decode(ContextReply, made).ctx)
            except ReplicaLost:
                channel.close()
                if last:
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

    @property
    def _went(self) -> str:
        return "left" if self._notice is not None else "died"

    def _addresses(self, deadline: float) -> Iterator[tuple[str, bool]]:
        """Where to go, each with whether a pause follows it: first the replica the one that left handed its
        contexts to (in the form of it this inferlet reaches, when its failover list has one), then the failover
        addresses, round and round, until ``deadline``."""
        if self._notice is not None:
            given = self._notice.addresses
            targets = [a for a in given if a in self.failover] or given
            for i, address in enumerate(targets):
                yield address, i == len(targets) - 1 and not self.failover
        for address in itertools.cycle(self.failover):
            if time.monotonic() > deadline:
                return
            yield address, address == self.failover[-1]

    def _claims(self) -> list[dict]:
        """A ``claim`` of every live context by its id on the replica it was on."""
        return [encode(Claim(ctx._id, ctx.lineage.known())) for ctx in self.contexts]

    def _restorable(self, claimed: list | None) -> Iterator[tuple[Context, tuple]]:
        """Take up the contexts the replica answered ``claim`` with (they came with their KV); then each other
        live context that can be recomputed, with the ``restore`` arguments that do it; the rest are lost."""
        contexts = list(self.contexts)
        if claimed is not None and len(claimed) != len(contexts):
            raise ReplicaError(f"claim answered {len(claimed)} contexts for {len(contexts)} asked")
        rest = []
        for ctx, made in zip(contexts, claimed or [None] * len(contexts), strict=True):
            if made is None:
                rest.append(ctx)
                continue
            reply = decode(ContextReply, made)
            ctx.moved(reply.ctx)
            if reply.recomputable:
                ctx.lineage.extend(reply.seq_len, reply.tail, reply.tail_positions)
            self.transferred += 1
        for ctx in rest:
            lineage = ctx.lineage
            if lineage.lost:
                ctx.lose(f"its replica {self._went}, and {lineage.lost}")
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
        died took the contexts with it (one that left, to where they are released unclaimed) and there is nothing to
        report; elsewhere its loss raises."""
        try:
            if self._moving is not None:
                self._moving.cancel()
            self.channel.call_sync("close")
        except ReplicaLost as e:
            if not self.failover and not isinstance(e, ReplicaMoved):
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
        except ReplicaLost as e:
            if not self.failover and not isinstance(e, ReplicaMoved):
                raise
        finally:
            self.channel.close()


def _resolved(args: tuple) -> list:
    return [a() if callable(a) else a for a in args]
