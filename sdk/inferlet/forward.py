"""``Forward``: one raw forward pass over a context, and ``Output``: what it returned.

Pages are the replica's business: it reserves what a pass needs, commits full pages to the shared prefix trie, and
reports the context's new ``seq_len``. Sampler and probe handles index into the output's slots in attach order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pie_workers.wire.batch import SampledLogprobs, SlotKind, SlotOutput
from pie_workers.wire.brle import pack as pack_brle
from pie_workers.wire.codec import output_from_wire, slot_to_wire
from pie_workers.wire.messages import PassKind, PassRequest

from inferlet import runtime
from inferlet.adapter import Adapter, check_zo_seed
from inferlet.sampler import Probe, Sampler

if TYPE_CHECKING:
    from inferlet.context import Context


@dataclass(frozen=True)
class SampleHandle:
    slots: tuple[int, ...]


@dataclass(frozen=True)
class ProbeHandle:
    slot: int
    kind: SlotKind


@dataclass
class Output:
    raw: list[SlotOutput]
    tokens: list[int] = field(default_factory=list)  # Generator-accepted tokens this step (empty for raw Forward)
    auto_sampler: SampleHandle | None = None
    walk: list[int] = field(default_factory=list)  # verified drafts and the token after them; a chained pass's tokens
    next_drafts: list[int] = field(default_factory=list)  # the replica's n-gram drafts (``Forward.ask_drafts``)

    def token(self, h: SampleHandle | ProbeHandle) -> int | None:
        """The token of a single-index sampler; None for a probe's handle or a slot the pass did not produce."""
        if not isinstance(h, SampleHandle) or not h.slots or h.slots[0] >= len(self.raw):
            return None
        return self.raw[h.slots[0]].token

    def tokens_at(self, h: SampleHandle | ProbeHandle) -> list[int]:
        """The tokens of a (multi-index) sampler; empty for a probe's handle."""
        if not isinstance(h, SampleHandle):
            return []
        return [self.raw[i].token for i in h.slots if i < len(self.raw)]

    def sampled_logprobs(self, h: SampleHandle | ProbeHandle) -> SampledLogprobs | None:
        """The sampled token's log-probability and the most likely alternatives, for a single-index sampler made
        with ``Sampler.with_logprobs``; None for any other handle."""
        if not isinstance(h, SampleHandle) or not h.slots or h.slots[0] >= len(self.raw):
            return None
        return self.raw[h.slots[0]].sampled_logprobs

    def _probe(self, h: SampleHandle | ProbeHandle, kind: SlotKind):
        """The slot of a probe of ``kind``; None for any other handle (a sampler's, another probe's), as the
        accessors return None for a handle that did not ask for what they read."""
        if not isinstance(h, ProbeHandle) or h.kind is not kind or h.slot >= len(self.raw):
            return None
        return self.raw[h.slot]

    def distribution(self, h: SampleHandle | ProbeHandle) -> tuple[list[int], list[float]] | None:
        out = self._probe(h, SlotKind.DISTRIBUTION)
        return None if out is None else out.distribution

    def logits(self, h: SampleHandle | ProbeHandle) -> bytes | None:
        out = self._probe(h, SlotKind.LOGITS)
        return None if out is None else out.logits

    def logprobs(self, h: SampleHandle | ProbeHandle) -> list[float] | None:
        out = self._probe(h, SlotKind.LOGPROBS)
        return None if out is None else out.logprobs

    def entropy(self, h: SampleHandle | ProbeHandle) -> float | None:
        out = self._probe(h, SlotKind.ENTROPY)
        return None if out is None else out.entropy


class Forward:
    """One pass: the builder methods of the SDK reference, then ``execute``. The Generator also sends drafts to
    verify, asks for n-gram drafts, chains passes and runs steps ahead through the methods below them, and may
    send a pass (``send``) before it reads the answer (``finish``)."""

    def __init__(self, ctx: Context):
        ctx.check_live()
        self._ctx = ctx
        self._start = ctx.seq_len
        self._request = PassRequest(ctx=ctx.id)
        self._slots: list[tuple[int, object]] = []  # (row, sampler or probe slot), on the wire at ``send``
        self._adapter: Adapter | None = None

    def start_position(self) -> int:
        """Position the first auto-input token occupies: the context's ``seq_len`` when ``forward()`` was called."""
        return self._start

    def input(self, tokens: list[int]) -> Forward:
        """Append tokens at the next positions after everything already in this pass."""
        return self.input_at(tokens, list(range(self._next_position(), self._next_position() + len(tokens))))

    def input_at(self, tokens: list[int], positions: list[int]) -> Forward:
        """Append tokens with explicit RoPE positions (their KV still goes into the next slots)."""
        if len(tokens) != len(positions):
            raise ValueError(f"input_at: {len(tokens)} tokens but {len(positions)} positions")
        self._request.tokens += [int(t) for t in tokens]
        self._request.positions += [int(p) for p in positions]
        return self

    def attention_mask(self, masks: list[list[int]]) -> Forward:
        """One BRLE row per input token over the context's KV slots ``[0, seq_len + inputs)``; true = attend."""
        self._request.attention_masks = [list(m) for m in masks]
        return self

    def mask(self, brle: list[int]) -> Forward:
        """A logit mask (BRLE over the vocabulary, true = allowed) applied at every sampled row; a malformed one
        raises here."""
        self._request.logit_mask = pack_brle(brle, "logit mask")  # packed: the replica reads it in place
        return self

    def adapter(self, adapter: Adapter) -> Forward:
        """Run this pass under a LoRA adapter (every input row)."""
        if not isinstance(adapter, Adapter):
            raise TypeError(f"adapter() needs an Adapter, got {type(adapter).__name__}")
        self._adapter = adapter
        return self

    def zo_seed(self, seed: int) -> Forward:
        """Perturb the adapter for this pass only, deterministically from ``seed`` (Evolution Strategies); a negative
        seed gives the mirrored perturbation of its absolute value. KV written this way is never shared by prefix."""
        self._request.zo_seed = check_zo_seed(seed)
        return self

    def sample(self, indices: list[int], sampler: Sampler) -> SampleHandle:
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sample() needs a Sampler, got {type(sampler).__name__}")
        first = len(self._slots)
        self._slots += [(int(i), sampler.slot) for i in indices]
        return SampleHandle(tuple(range(first, len(self._slots))))

    def probe(self, index: int, probe: Probe) -> ProbeHandle:
        if not isinstance(probe, Probe):
            raise TypeError(f"probe() needs a probe (Logits, Distribution, ...), got {type(probe).__name__}")
        self._slots.append((int(index), probe.slot))
        return ProbeHandle(len(self._slots) - 1, probe.kind)

    async def execute(self) -> Output:
        return self.finish(await self.send())

    # -- what the Generator adds ---------------------------------------------------------------------------------

    def drafts(self, tokens: list[int], masks: list[list[int]] | None = None) -> Forward:
        """Draft tokens to verify after the inputs, at the positions right after them: the first sampler's row
        checks them, and the accepted ones with the token sampled after them come back as ``Output.walk``.
        ``masks``: a BRLE logit mask per draft row (a grammar's, after the drafts before it)."""
        first = self._next_position()
        self._request.drafts = [int(t) for t in tokens]
        self._request.draft_positions = list(range(first, first + len(tokens)))
        self._request.draft_masks = None if masks is None else [pack_brle(m, "draft mask") for m in masks]
        return self

    def ask_drafts(self, n: int) -> Forward:
        """Have the replica propose up to ``n`` drafts for the next step from the context's n-gram index
        (``Output.next_drafts``)."""
        self._request.draft_budget = int(n)
        return self

    def run_ahead(self, stop_ids: list[int]) -> Forward:
        """Have the replica run the next step on the token this pass samples, unless it is one of ``stop_ids``, while
        the answer travels; a pass that repeats that step is answered from it."""
        self._request.run_ahead, self._request.stop_ids = True, list(stop_ids)
        return self

    def chain(self, position: int, stop_ids: list[int], steps: int) -> Forward:
        """Make this a pass chained on the context's previous one: its input is the token that pass samples, at
        ``position``, and it runs up to ``steps`` steps, ending after one that samples a token of ``stop_ids``."""
        request = self._request
        request.kind, request.positions, request.stop_ids, request.steps = PassKind.CHAINED, [position], stop_ids, steps
        return self

    def bid(self, bid: float) -> Forward:
        """The context's bid from this pass on (a Generator's default bid rides with its step)."""
        self._request.bid = bid
        return self

    @property
    def input_tokens(self) -> list[int]:
        return list(self._request.tokens)

    def send(self, hold: int = 0) -> asyncio.Future:
        """Queue the pass on the channel; ``finish`` reads the future's answer. ``hold``: tokens at the end whose
        pages stay uncommitted, as the Generator may still undo them (accepted drafts are held too)."""
        request = self._request
        if not request.tokens and not request.chained:
            raise ValueError("forward pass has no input tokens: call input() or input_at() first")
        if request.zo_seed is not None and self._adapter is None:
            raise ValueError("zo_seed perturbs an adapter: call adapter() on this pass too")
        request.adapter = None if self._adapter is None else self._adapter.id_on(self._ctx.model)
        request.slots = [[row, slot_to_wire(s)] for row, s in self._slots]
        request.hold = len(request.drafts) + hold  # accepted drafts may still be cut at a stop token
        return self._ctx.send(request)

    def finish(self, answer: dict) -> Output:
        """The pass's ``Output`` from its answer on the wire (the context's length follows it)."""
        reply = self._ctx.received(answer)
        outputs = [output_from_wire(s) for s in reply.slots]
        # generated: a chained pass's or a verified draft run's tokens (the walk), else the sampled slots
        runtime.current().spend_tokens(len(reply.walk) or sum(o.token is not None for o in outputs))
        return Output(outputs, walk=reply.walk, next_drafts=reply.next_drafts)

    def _next_position(self) -> int:
        positions = self._request.positions
        return positions[-1] + 1 if positions else self._start
