"""The ragged forward batch handed to a model runner, and what comes back.

A request names its own KV pages and its explicit ``kv_len`` (tokens already in KV). New KV for the request's input
tokens — then its draft tokens — goes into the next slots after ``kv_len``; positions only feed RoPE. The runner
keeps no state between batches: everything it needs is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class SlotKind(StrEnum):
    """What one output slot computes from one row's logits (after the request's logit mask)."""

    # token samplers
    MULTINOMIAL = "multinomial"
    TOP_K = "top_k"
    TOP_P = "top_p"
    MIN_P = "min_p"
    TOP_K_TOP_P = "top_k_top_p"
    # probes: see masked, untempered logits (Distribution applies its own temperature)
    DISTRIBUTION = "distribution"
    LOGITS = "logits"
    LOGPROBS = "logprobs"
    ENTROPY = "entropy"

    @property
    def is_token(self) -> bool:
        return self in _TOKEN_KINDS


_TOKEN_KINDS = {SlotKind.MULTINOMIAL, SlotKind.TOP_K, SlotKind.TOP_P, SlotKind.MIN_P, SlotKind.TOP_K_TOP_P}

# A token sampler at or below this temperature is argmax.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class Slot:
    """A sampler or probe. Unused parameters keep neutral values (top_k=0 and top_p=1 mean no filter).

    ``seed`` applies to token samplers: 0 draws fresh randomness, any other value makes the draw reproducible.
    ``token_ids`` are the labels of a LOGPROBS probe; ``top_k`` is also the size of a DISTRIBUTION (0 = whole vocab).
    ``report_logprobs`` >= 0 makes a token sampler also report the sampled token's log-probability and that many
    most likely alternatives, from the masked, untempered logits (what OpenAI's ``logprobs`` return); -1: the token
    alone.
    """

    kind: SlotKind
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    token_ids: tuple[int, ...] = ()
    report_logprobs: int = -1

    @staticmethod
    def argmax() -> Slot:
        return Slot(SlotKind.TOP_P, temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.kind.is_token and self.temperature <= GREEDY_TEMPERATURE


@dataclass(slots=True)
class ForwardRequest:
    """One request's part of a batch.

    ``page_ids`` must cover ``kv_len + len(token_ids) + len(draft_tokens)`` slots. ``attention_masks`` holds one BRLE
    per input row (then per draft row, or drafts default to causal) over the request's KV slots
    ``[0, kv_len + n_inputs + n_drafts)``; None means causal. ``slots`` pairs input-row indices with samplers/probes;
    outputs come back in the same order. With drafts, the first token sampler verifies them. ``logit_mask`` applies
    to every sampled row unless ``draft_masks`` gives each draft row its own (a grammar's mask after that draft;
    ``[]`` = unrestricted) — the slot rows keep ``logit_mask``. ``adapter`` names a LoRA
    adapter the runner holds, applied to every row of this request; ``zo_seed`` perturbs that adapter for this pass
    only (Evolution Strategies: a negative seed gives the mirrored perturbation of its absolute value).
    """

    token_ids: list[int]
    positions: list[int]
    page_ids: list[int]
    kv_len: int
    slots: list[tuple[int, Slot]] = field(default_factory=list)
    attention_masks: list[list[int]] | None = None
    logit_mask: bytes | Sequence[int] | None = None  # packed (brle.pack, as the channel sends it), or the runs
    draft_tokens: list[int] = field(default_factory=list)
    draft_positions: list[int] = field(default_factory=list)
    draft_masks: Sequence[bytes | Sequence[int]] | None = None
    adapter: int | None = None
    zo_seed: int | None = None


@dataclass(slots=True)
class ForwardBatch:
    """A ragged batch. Before the forward, in this order: ``offloads`` (page, host slot) copy pages out to host
    memory (a suspended context's KV), ``restores`` (host slot, page) copy them back, ``page_copies`` (src, dst)
    copy pages within the pool (forks)."""

    requests: list[ForwardRequest]
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    offloads: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SlotOutput:
    """One slot's result; exactly one field is set, matching the slot's kind."""

    token: int | None = None
    distribution: tuple[list[int], list[float]] | None = None
    logits: bytes | None = None
    logprobs: list[float] | None = None
    entropy: float | None = None
    sampled_logprobs: SampledLogprobs | None = None  # with ``token``, when its slot asked for ``report_logprobs``


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """The sampled token's log-probability and the most likely alternatives (ids and log-probabilities,
    descending)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RequestOutput:
    """Per-request result. ``tokens`` is the verified walk when drafts were sent: accepted drafts + one bonus token.

    ``error`` is set when the request was rejected; it had no effect on the KV pool or on other requests.
    """

    slots: list[SlotOutput] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
