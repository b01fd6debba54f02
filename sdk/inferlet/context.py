"""``Context``: a KV cache on a replica, plus the tokens the inferlet has queued but not yet run (the buffer).

Filling methods (``system``, ``user``, ``cue``, ...) only extend the buffer; ``flush`` or the next generation step
runs it. Lifetime and snapshot operations are synchronous round trips to the replica; forward passes are awaited.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager

from pie_workers.wire.messages import ContextReply, PassReply, PassRequest, decode, encode

from inferlet.forward import Forward
from inferlet.model import Model
from inferlet.sampler import Sampler


class Context:
    def __init__(self, model: Model, *, _id: int | None = None, _seq_len: int = 0, _buffer: list[int] | None = None):
        self._model = model
        self._id = model.channel.call_sync("create") if _id is None else _id
        self._seq_len = _seq_len
        self._buffer: list[int] = list(_buffer or [])
        self._released = False
        self._bid = 0.0  # credits per page offered to keep this context resident
        self._explicit_bid = False  # set by set_bid: a Generator's default bid no longer applies
        self._idle = False

    # -- lifetime --------------------------------------------------------------------------------------------------

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @classmethod
    async def create(cls, model: Model) -> Context:
        """``Context(model)`` without blocking the event loop while the replica answers: where many inferlets share
        one loop (the cluster's serving programs), a blocking call would hold all of them for that round trip."""
        return cls(model, _id=await model.channel.call("create"))

    def release(self) -> None:
        """Free this context's pages now (idempotent)."""
        if not self._released:
            self._released = True
            self._model.channel.call_sync("destroy", self._id)

    async def release_async(self) -> None:
        """``release`` without blocking the event loop (see ``create``)."""
        if not self._released:
            self._released = True
            await self._model.channel.call("destroy", self._id)

    def check_live(self) -> None:
        """Raise ValueError if the context was released."""
        if self._released:
            raise ValueError(f"context {self._id} was released; it can no longer be used")

    @staticmethod
    def open(model: Model, name: str) -> Context | None:
        """A copy of the snapshot ``name`` (the snapshot stays), or None if there is none."""
        return Context._made(model, model.channel.call_sync("open", name))

    @staticmethod
    def take(model: Model, name: str) -> Context | None:
        """The snapshot ``name`` itself (it is removed), or None if there is none."""
        return Context._made(model, model.channel.call_sync("take", name))

    @staticmethod
    def delete(model: Model, name: str) -> None:
        model.channel.call_sync("delete", name)

    def fork(self) -> Context:
        """A copy-on-write clone: shares every committed page, copies the partly filled one, copies the buffer;
        it starts with this context's bid."""
        self.check_live()
        return self._child(decode(ContextReply, self._model.channel.call_sync("fork", self._id)))

    def _child(self, made: ContextReply) -> Context:
        child = Context(self._model, _id=made.ctx, _seq_len=made.seq_len, _buffer=self._buffer)
        child._bid, child._explicit_bid = (0.0, False) if self._idle else (self._bid, self._explicit_bid)
        return child

    async def fork_async(self) -> Context:
        """``fork`` without blocking the event loop (see ``create``)."""
        self.check_live()
        return self._child(decode(ContextReply, await self._model.channel.call("fork", self._id)))

    def save(self, name: str) -> None:
        """Snapshot the KV cache under ``name``, per user and model across the cluster. It lives until deleted or
        taken, beyond this inferlet and the replica that saved it (any replica recomputes it from its token lineage),
        except one written under a custom mask, an adapter or a zo seed, which opens only on the saving replica."""
        self.check_live()
        self._model.channel.call_sync("save", self._id, name)

    def snapshot(self) -> str:
        self.check_live()
        return self._model.channel.call_sync("snapshot", self._id)

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
        self._seq_len = self._model.channel.call_sync("truncate", self._id, int(n))

    async def truncate_async(self, n: int) -> None:
        """``truncate``, awaited: the other inferlets of this process run meanwhile."""
        self.check_live()
        self._seq_len = await self._model.channel.call("truncate", self._id, int(n))

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
        self._model.channel.call_sync("suspend", self._id)

    def _send_bid(self, bid: float) -> None:
        self._model.channel.call_sync("set_bid", self._id, bid)
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
        return self._model.channel.call("forward", encode(request))

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
        return Context(model, _id=made.ctx, _seq_len=made.seq_len)

    def generate(self, sampler: Sampler, **options):
        from inferlet.generator import Generator

        return Generator(self, sampler, **options)
