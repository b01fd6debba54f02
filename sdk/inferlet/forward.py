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
    def __init__(self, ctx: Context):
        ctx._check_live()
        self._ctx = ctx
        self._start = ctx.seq_len
        self._tokens: list[int] = []
        self._positions: list[int] = []
        self._slots: list[tuple[int, object]] = []
        self._masks: list[list[int]] | None = None
        self._logit_mask: bytes | None = None  # packed: masks travel as bytes the replica reads in place
        self._adapter: Adapter | None = None
        self._zo_seed: int | None = None
        # Speculation, set by the Generator: drafts verified after the inputs, and n-gram drafts asked back.
        self._drafts: list[int] = []
        self._draft_positions: list[int] = []
        self._draft_masks: list[list[int]] | None = None
        self._draft_budget = 0
        self._walk: list[int] = []  # the verified walk: accepted drafts, then the sampler's next token
        self._next_drafts: list[int] = []
        self._bid: float | None = None  # set by a Generator: the context's default bid from this pass on
        self._ahead: list[int] | None = None  # set by a Generator: stop ids, to have the next step run ahead

    def start_position(self) -> int:
        """Position the first auto-input token occupies: the context's ``seq_len`` when ``forward()`` was called."""
        return self._start

    def input(self, tokens: list[int]) -> Forward:
        """Append tokens at the next positions after everything already in this pass."""
        first = self._positions[-1] + 1 if self._positions else self._start
        return self.input_at(tokens, list(range(first, first + len(tokens))))

    def input_at(self, tokens: list[int], positions: list[int]) -> Forward:
        """Append tokens with explicit RoPE positions (their KV still goes into the next slots)."""
        if len(tokens) != len(positions):
            raise ValueError(f"input_at: {len(tokens)} tokens but {len(positions)} positions")
        self._tokens += [int(t) for t in tokens]
        self._positions += [int(p) for p in positions]
        return self

    def attention_mask(self, masks: list[list[int]]) -> Forward:
        """One BRLE row per input token over the context's KV slots ``[0, seq_len + inputs)``; true = attend."""
        self._masks = [list(m) for m in masks]
        return self

    def mask(self, brle: list[int]) -> Forward:
        """A logit mask (BRLE over the vocabulary, true = allowed) applied at every sampled row; a malformed one
        raises here."""
        self._logit_mask = pack_brle(brle, "logit mask")
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
        self._zo_seed = check_zo_seed(seed)
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
        return self._finish(await self._send())

    def _send(self, chained: list[int] | None = None, steps: int = 1, hold: int = 0) -> asyncio.Future:
        """Queue the pass on the channel; the future's reply goes to ``_finish``. ``chained``: the Generator's stop
        ids for a pass whose input is the token the previous pass sampled, run for up to ``steps`` steps (see the
        replica's ``PassArgs``). ``hold``: tokens at the end whose pages stay uncommitted, as the Generator may
        still undo them."""
        if not self._tokens and chained is None:
            raise ValueError("forward pass has no input tokens: call input() or input_at() first")
        ctx = self._ctx
        ctx._check_live()
        if self._zo_seed is not None and self._adapter is None:
            raise ValueError("zo_seed perturbs an adapter: call adapter() on this pass too")
        adapter_id = None if self._adapter is None else self._adapter._id_for(ctx.model)
        return ctx.model.channel.call(
            "forward",
            ctx._id,
            self._tokens,
            self._positions,
            [[row, slot_to_wire(s)] for row, s in self._slots],
            self._masks,
            self._logit_mask,
            self._drafts,
            self._draft_positions,
            len(self._drafts) + hold,  # accepted drafts may still be cut at a stop token
            adapter_id,
            self._zo_seed,
            None if self._draft_masks is None else [pack_brle(m, "draft mask") for m in self._draft_masks],
            self._draft_budget,
            self._bid,
            chained,
            steps,
            self._ahead,
        )

    def _finish(self, reply: list) -> Output:
        slots, self._walk, seq_len, self._next_drafts = reply
        self._ctx._seq_len = seq_len
        outputs = [output_from_wire(s) for s in slots]
        # generated: a chained pass's or a verified draft run's tokens (the walk), else the sampled slots
        runtime.current().spend_tokens(len(self._walk or ()) or sum(o.token is not None for o in outputs))
        return Output(outputs)
