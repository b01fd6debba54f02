"""Compact msgpack-friendly forms of slots and slot outputs, for the channel between inferlets and a replica."""

from __future__ import annotations

import functools

from pie_workers.wire.batch import SampledLogprobs, Slot, SlotKind, SlotOutput

_KINDS = list(SlotKind)
_CODE = {kind: i for i, kind in enumerate(_KINDS)}


def slot_to_wire(slot: Slot) -> list:
    return [
        _CODE[slot.kind],
        slot.temperature,
        slot.top_k,
        slot.top_p,
        slot.min_p,
        slot.seed,
        list(slot.token_ids),
        slot.report_logprobs,
    ]


def slot_from_wire(data: list) -> Slot:
    if not isinstance(data, (list, tuple)) or len(data) != 8:
        raise ValueError(f"malformed sampler on the wire: {data!r:.200}")
    code, temperature, top_k, top_p, min_p, seed, token_ids, report_logprobs = data
    try:
        return _slot(code, temperature, top_k, top_p, min_p, seed, tuple(token_ids), report_logprobs)
    except TypeError:  # a list where a number belongs: unhashable, so the cache refuses it
        raise ValueError(f"malformed sampler on the wire: {data!r}") from None


@functools.lru_cache(maxsize=4096)
def _slot(code, temperature, top_k, top_p, min_p, seed, token_ids: tuple, report_logprobs) -> Slot:
    """Decoded once per distinct sampler: a Generator sends the same one every step, and building a frozen
    dataclass costs more than the lookup."""
    if not isinstance(code, int) or not 0 <= code < len(_KINDS):
        raise ValueError(f"unknown sampler kind code {code!r}")
    numbers = float(temperature), int(top_k), float(top_p), float(min_p), int(seed)
    return Slot(_KINDS[code], *numbers, token_ids, int(report_logprobs))


def output_to_wire(out: SlotOutput) -> list:
    """[tag, value]: t=token, tl=token with its logprobs, d=distribution (ids, probs), l=logits bytes,
    p=logprobs, e=entropy."""
    if out.sampled_logprobs is not None:
        lp = out.sampled_logprobs
        return ["tl", [out.token, lp.logprob, lp.top_ids, lp.top_logprobs]]
    if out.token is not None:
        return ["t", out.token]
    if out.distribution is not None:
        return ["d", [out.distribution[0], out.distribution[1]]]
    if out.logits is not None:
        return ["l", out.logits]
    if out.logprobs is not None:
        return ["p", out.logprobs]
    return ["e", out.entropy]


def output_from_wire(data: list) -> SlotOutput:
    tag, value = data
    if tag == "t":
        return SlotOutput(token=value)
    if tag == "tl":
        token, logprob, top_ids, top_logprobs = value
        return SlotOutput(token=token, sampled_logprobs=SampledLogprobs(logprob, top_ids, top_logprobs))
    if tag == "d":
        return SlotOutput(distribution=(value[0], value[1]))
    if tag == "l":
        return SlotOutput(logits=value)
    if tag == "p":
        return SlotOutput(logprobs=value)
    return SlotOutput(entropy=value)
