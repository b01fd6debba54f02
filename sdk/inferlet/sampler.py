"""Samplers (how the next token is chosen) and probes (what else to read off a row's distribution)."""

from __future__ import annotations

import dataclasses

from pie_workers.wire.batch import Slot, SlotKind


class Sampler:
    """A token sampler attached to a forward-pass row. Construct with the class methods."""

    __slots__ = ("slot",)

    def __init__(self, slot: Slot):
        self.slot = slot

    def __repr__(self) -> str:
        return f"Sampler({self.slot})"

    def with_logprobs(self, top: int = 0) -> Sampler:
        """This sampler, also reporting each sampled token's log-probability and its ``top`` most likely
        alternatives (read them with ``Output.sampled_logprobs``); log-probabilities are of the masked, untempered
        distribution, as OpenAI's ``logprobs`` are."""
        if not 0 <= top <= 1024:
            raise ValueError(f"with_logprobs(top) needs 0 <= top <= 1024, got {top}")
        return Sampler(dataclasses.replace(self.slot, report_logprobs=top))

    @staticmethod
    def argmax() -> Sampler:
        return Sampler(Slot.argmax())

    @staticmethod
    def top_p(temperature: float, p: float) -> Sampler:
        return Sampler(Slot(SlotKind.TOP_P, temperature=temperature, top_p=p))

    @staticmethod
    def top_k(temperature: float, k: int) -> Sampler:
        return Sampler(Slot(SlotKind.TOP_K, temperature=temperature, top_k=k))

    @staticmethod
    def min_p(temperature: float, p: float) -> Sampler:
        return Sampler(Slot(SlotKind.MIN_P, temperature=temperature, min_p=p))

    @staticmethod
    def top_k_top_p(temperature: float, k: int, p: float) -> Sampler:
        return Sampler(Slot(SlotKind.TOP_K_TOP_P, temperature=temperature, top_k=k, top_p=p))

    @staticmethod
    def multinomial(temperature: float, draws: int = 0) -> Sampler:
        """``draws`` seeds the draw (as in Pie): 0 is fresh randomness, any other value is reproducible."""
        return Sampler(Slot(SlotKind.MULTINOMIAL, temperature=temperature, seed=draws))


class Probe:
    """Base of the probes: each reads one thing off one row's (masked, untempered) logits."""

    __slots__ = ("slot",)
    kind: SlotKind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.slot})"


class Logits(Probe):
    """Raw logits as native-endian float32 bytes (vocab_size * 4)."""

    kind = SlotKind.LOGITS

    def __init__(self):
        self.slot = Slot(SlotKind.LOGITS)


class Distribution(Probe):
    """Top-k (ids, probs) of softmax(logits / temperature); k = 0 is the whole vocabulary."""

    kind = SlotKind.DISTRIBUTION

    def __init__(self, temperature: float = 1.0, k: int = 0):
        self.slot = Slot(SlotKind.DISTRIBUTION, temperature=temperature, top_k=k)


class Logprob(Probe):
    kind = SlotKind.LOGPROBS

    def __init__(self, token_id: int):
        self.slot = Slot(SlotKind.LOGPROBS, token_ids=(int(token_id),))


class Logprobs(Probe):
    kind = SlotKind.LOGPROBS

    def __init__(self, token_ids: list[int]):
        self.slot = Slot(SlotKind.LOGPROBS, token_ids=tuple(int(t) for t in token_ids))


class Entropy(Probe):
    kind = SlotKind.ENTROPY

    def __init__(self):
        self.slot = Slot(SlotKind.ENTROPY)
