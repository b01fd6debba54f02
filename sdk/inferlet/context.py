"""``Context``: a KV cache on a replica, plus the tokens the inferlet has queued but not yet run (the buffer).

Filling methods (``system``, ``user``, ``cue``, ...) only extend the buffer; ``flush`` or the next generation step
runs it. Lifetime and snapshot operations are synchronous round trips to the replica; forward passes are awaited.
Where the model has failover addresses, each context keeps its ``Lineage``, so that it is recomputed on another
replica if its own dies (``inferlet._failover``); its ``id`` then changes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from pie_workers.wire.messages import ContextReply, PassReply, PassRequest, decode, encode

from inferlet._channel import ReplicaLost
from inferlet._failover import ContextLost
from inferlet._lineage import SALTED, Lineage
from inferlet.forward import Forward
from inferlet.model import Model
from inferlet.sampler import Sampler

NOT_MIRRORED = "no other replica was named to move it to"


class Context:
    """A KV cache on a replica. ``cache_salt``: it reuses cached prefix pages only of its own user's contexts made
    with the same salt (vLLM's ``cache_salt``; none: those made with none)."""

    def __init__(
        self,
        model: Model,
        *,
        cache_salt: str = "",
        _id: int | None = None,
        _seq_len: int = 0,
        _buffer: list[int] | None = None,
        _lineage: Lineage | None = None,
    ):
        self._model = model
        self._link = link = model.link
        self._id = link.call_sync("create", *_salted(cache_salt)) if _id is None else _id
        self._seq_len = _seq_len
        self._buffer: list[int] = list(_buffer or [])
        self._released = False
        self._lost: str | None = None  # why it is gone with its replica (``inferlet._failover``)
        self.lineage = _lineage or (Lineage(cache_salt=cache_salt) if link.mirrors else Lineage(lost=NOT_MIRRORED))
        link.contexts[self] = None
        self._bid = 0.0  # credits per page offered to keep this context resident
        self._explicit_bid = False  # set by set_bid: a Generator's default bid no longer applies
        self._idle = False

    # -- lifetime --------------------------------------------------------------------------------------------------

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @classmethod
    async def create(cls, model: Model, cache_salt: str = "") -> Context:
        """``Context(model)`` without blocking the event loop while the replica answers: where many inferlets share
        one loop (the cluster's serving programs), a blocking call would hold all of them for that round trip."""
        made = await model.link.call("create", *_salted(cache_salt))
        return cls(model, cache_salt=cache_salt, _id=made)

    def release(self) -> None:
        """Free this context's pages now (idempotent)."""
        if self._forget():
            with suppress(ReplicaLost):  # it died with its replica, and no move brings it back
                self._link.channel.call_sync("destroy", self._id)

    async def release_async(self) -> None:
        """``release`` without blocking the event loop (see ``create``)."""
        if self._forget():
            with suppress(ReplicaLost):
                await self._link.channel.call("destroy", self._id)

    def _forget(self) -> bool:
        """Mark the context released; whether its replica still holds it (none does while it moves)."""
        if self._released:
            return False
        self._released = True
        self._link.contexts.pop(self, None)
        return self._lost is None and not self._link.moving

    def check_live(self) -> None:
        """Raise ValueError if the context was released, ``ContextLost`` if it was lost with its replica."""
        if self._released:
            raise ValueError(f"context {self._id} was released; it can no longer be used")
        if self._lost is not None:
            raise ContextLost(f"context {self._id} is lost: {self._lost}")

    def _ref(self) -> int:
        """Its id on the replica it is on now (read when a call is sent, so a call sent again after a move names
        the context there)."""
        self.check_live()
        return self._id

    def moved(self, ctx: int) -> None:
        """It was recomputed on another replica, as context ``ctx`` there."""
        self._id = ctx

    def lose(self, why: str) -> None:
        """It went with its replica and could not be recomputed: every later use raises ``ContextLost``."""
        self._lost = why
        self._link.contexts.pop(self, None)

    @staticmethod
    def open(model: Model, name: str) -> Context | None:
        """A copy of the snapshot ``name`` (the snapshot stays), or None if there is none."""
        return Context._made(model, model.link.call_sync("open", name, 0 if model.link.mirrors else -1))

    @staticmethod
    def take(model: Model, name: str) -> Context | None:
        """The snapshot ``name`` itself (it is removed), or None if there is none."""
        return Context._made(model, model.link.call_sync("take", name, 0 if model.link.mirrors else -1))

    @staticmethod
    def delete(model: Model, name: str) -> None:
        model.link.call_sync("delete", name)

    def fork(self) -> Context:
        """A copy-on-write clone: shares every committed page, copies the partly filled one, copies the buffer;
        it starts with this context's bid."""
        self.check_live()
        return self._child(decode(ContextReply, self._link.call_sync("fork", self._ref, self.lineage.known())))

    def _child(self, made: ContextReply) -> Context:
        lineage = self.lineage.child(made.seq_len, made.tail, made.tail_positions)
        child = Context(self._model, _id=made.ctx, _seq_len=made.seq_len, _buffer=self._buffer, _lineage=lineage)
        child._bid, child._explicit_bid = (0.0, False) if self._idle else (self._bid, self._explicit_bid)
        return child

    async def fork_async(self) -> Context:
        """``fork`` without blocking the event loop (see ``create``)."""
        self.check_live()
        return self._child(decode(ContextReply, await self._link.call("fork", self._ref, self.lineage.known())))

    def save(self, name: str) -> None:
        """Snapshot the KV cache under ``name``, per user and model across the cluster. It lives until deleted or
        taken, beyond this inferlet and the replica that saved it (any replica recomputes it from its token lineage),
        except one written under a custom mask, an adapter or a zo seed, which opens only on the saving replica."""
        self.check_live()
        self._link.call_sync("save", self._ref, name)

    def snapshot(self) -> str:
        self.check_live()
        return self._link.call_sync("snapshot", self._ref)

    def save_and_release(self, name: str) -> None:
        """``save(name)`` then ``release()``, in one step that moves the pages into the snapshot instead of copying
        the partly filled one (a copy waits for the replica's next batch): for a context that ends with its save."""
        self.check_live()
        self._link.call_sync("keep", self._ref, name)
        self._forget()

    # -- filling -------------------------------------------------------------------------------------------------

    def append(self, tokens: list[int]) -> Context:
        self.check_live()
        self._buffer += [int(t) for t in tokens]
        return self

    def system(self, text: str) -> Context:
        return self.append(self._model.instruct.system(text))

    def user(self, text: str) -> Context:
        return self.append(self._model.instruct.user(text))

    def assistant(self, text: str) -> Context:
        return self.append(self._model.instruct.assistant(text))

    def cue(self) -> Context:
        return self.append(self._model.instruct.cue())

    def seal(self) -> Context:
        return self.append(self._model.instruct.seal())

    async def flush(self) -> None:
        """Run the buffered tokens through the model (prefill); their pages are committed and shareable."""
        self.check_live()
        if self._buffer:
            fwd = Forward(self)
            fwd.input(self._buffer)
            await fwd.execute()
            self._buffer = []

    # -- inspection ----------------------------------------------------------------------------------------------

    @property
    def id(self) -> int:
        """The context's id on its replica."""
        return self._id

    @property
    def model(self) -> Model:
        return self._model

    @property
    def page_size(self) -> int:
        return self._model.page_size

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache (committed + working); excludes the buffer."""
        return self._seq_len

    def buffer(self) -> list[int]:
        return list(self._buffer)

    def truncate(self, n: int) -> None:
        """Drop the last ``n`` tokens of the KV cache (only tokens not yet committed: the rollback primitive)."""
        self.check_live()
        self._truncated(self._link.call_sync("truncate", self._ref, int(n)))

    async def truncate_async(self, n: int) -> None:
        """``truncate``, awaited: the other inferlets of this process run meanwhile."""
        self.check_live()
        await self._link.call("truncate", self._ref, int(n), noted=self._truncated)

    def _truncated(self, seq_len: int) -> None:
        self._seq_len = seq_len
        self.lineage.cut(seq_len)

    def take_buffer(self) -> list[int]:
        """The buffered tokens, leaving the buffer empty: a pass of one's own is about to run them."""
        taken, self._buffer = self._buffer, []
        return taken

    def requeue(self, tokens: list[int]) -> None:
        """Put tokens taken for a pass that did not run back at the front of the buffer."""
        self._buffer = [*tokens, *self._buffer]

    # -- memory market -----------------------------------------------------------------------------------------------

    def set_bid(self, bid: float) -> None:
        """Offer ``bid`` credits per page per tick to keep this context's pages when memory is short (higher bids
        stay resident; lower ones are suspended, their pages kept in host memory or recomputed when they are next
        used). It holds until changed, and overrides the default bid a Generator makes for the context from its
        balance and horizon (without either, the bid is 0)."""
        self.check_live()
        bid = float(bid)
        if not (bid >= 0.0 and math.isfinite(bid)):
            raise ValueError(f"set_bid: a bid is a finite number of credits >= 0, got {bid!r}")
        self._send_bid(bid)
        self._explicit_bid = True

    @contextmanager
    def idle(self) -> Iterator[Context]:
        """Bid 0 for the scope (the first to be suspended when memory is short; a Generator does not rebid inside
        it), then restore the previous bid. Passes still run inside it."""
        self.check_live()
        previous = self._bid
        self._send_bid(0.0)
        self._idle = True
        try:
            yield self
        finally:
            self._idle = False
            if not self._released:
                self._send_bid(previous)

    def suspend(self) -> None:
        """Give this context's pages up now, to whoever needs them (they wait in host memory when the replica has
        room, else they are recomputed); its next operation brings it back. A no-op if it is suspended already."""
        self.check_live()
        self._link.call_sync("suspend", self._ref)

    def _send_bid(self, bid: float) -> None:
        self._link.call_sync("set_bid", self._ref, bid)
        self._bid = bid

    @property
    def bid(self) -> float:
        """Credits per page per tick this context offers now."""
        return self._bid

    @property
    def bids_by_default(self) -> bool:
        """Whether a Generator bids for this context: not once the inferlet set a bid, nor while it is idle."""
        return not (self._explicit_bid or self._idle)

    def adopt_default_bid(self, bid: float) -> bool:
        """Take a Generator's default bid, to ride with its next pass; False (nothing to send) if it is the
        current one."""
        if bid == self._bid:
            return False
        self._bid = bid
        return True

    # -- passes --------------------------------------------------------------------------------------------------

    def forward(self) -> Forward:
        return Forward(self)

    def send(self, request: PassRequest) -> asyncio.Future:
        """Queue a pass over this context on the channel (``Forward.send``); ``received`` reads its answer."""
        self.check_live()
        salted = request.attention_masks is not None or request.adapter is not None or request.zo_seed is not None
        if salted and not self.lineage.lost:
            self.lineage.lose(SALTED)

        def encoded() -> dict:  # read when sent: after a move, the context's id and lineage there
            request.ctx, request.known = self._ref(), self.lineage.known()
            return encode(request)

        return self._link.call("forward", encoded, noted=self._passed)

    def _passed(self, answer: dict | None) -> None:
        """Follow a pass's answer in the lineage the moment it arrives (before a move could need it)."""
        if answer is not None and not self.lineage.lost:
            self.lineage.passed(answer)

    def received(self, answer: dict | None) -> PassReply | None:
        """A pass's answer off the wire (None: a chained pass that stopped before running); the context's length
        follows it."""
        if answer is None:
            return None
        reply = decode(PassReply, answer)
        self._seq_len = reply.seq_len
        return reply

    @staticmethod
    def _made(model: Model, answer: dict | None) -> Context | None:
        """The context an ``open`` or ``take`` answered with, if any."""
        if answer is None:
            return None
        made = decode(ContextReply, answer)
        if not model.link.mirrors:
            lineage = None
        elif made.recomputable:
            lineage = Lineage(made.tail, made.tail_positions)
        else:
            lineage = Lineage(lost=SALTED)
        return Context(model, _id=made.ctx, _seq_len=made.seq_len, _lineage=lineage)

    def generate(self, sampler: Sampler, **options):
        from inferlet.generator import Generator

        return Generator(self, sampler, **options)


def _salted(cache_salt: str) -> tuple[str, ...]:
    """``create``'s arguments: the salt, when there is one (the replica checks it: a string of at most
    ``MAX_CACHE_SALT`` characters)."""
    return (cache_salt,) if cache_salt else ()
