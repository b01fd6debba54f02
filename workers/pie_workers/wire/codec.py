"""Compact msgpack-friendly forms of slots and slot outputs, for the channel between inferlets and a replica."""

from __future__ import annotations

import functools

from pie_workers.wire.batch import Slot, SlotKind, SlotOutput

_KINDS = list(SlotKind)
_CODE = {kind: i for i, kind in enumerate(_KINDS)}


def slot_to_wire(slot: Slot) -> list:
    return [_CODE[slot.kind], slot.temperature, slot.top_k, slot.top_p, slot.min_p, slot.seed, list(slot.token_ids)]


def slot_from_wire(data: list) -> Slot:
    code, temperature, top_k, top_p, min_p, seed, token_ids = data
    try:
        return _slot(code, temperature, top_k, top_p, min_p, seed, tuple(token_ids))
    except TypeError:  # a list where a number belongs: unhashable, so the cache refuses it
        raise ValueError(f"malformed sampler on the wire: {data!r}") from None


@functools.lru_cache(maxsize=4096)
def _slot(code, temperature, top_k, top_p, min_p, seed, token_ids: tuple) -> Slot:
    """Decoded once per distinct sampler: a Generator sends the same one every step, and building a frozen
    dataclass costs more than the lookup."""
    if not isinstance(code, int) or not 0 <= code < len(_KINDS):
        raise ValueError(f"unknown sampler kind code {code!r}")
    return Slot(_KINDS[code], float(temperature), int(top_k), float(top_p), float(min_p), int(seed), token_ids)


def output_to_wire(out: SlotOutput) -> list:
    """[tag, value]: t=token, d=distribution (ids, probs), l=logits bytes, p=logprobs, e=entropy."""
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
    if tag == "d":
        return SlotOutput(distribution=(value[0], value[1]))
    if tag == "l":
        return SlotOutput(logits=value)
    if tag == "p":
        return SlotOutput(logprobs=value)
    return SlotOutput(entropy=value)
