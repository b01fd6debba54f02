"""Evaluate a batch's output slots (token samplers and probes) on already logit-masked rows.

All sampled token rows share one batched path: temperature, filters and the draw use per-row parameter
tensors whose neutral values make a filter a no-op, so a decode step costs a fixed handful of kernels however
the rows mix. The draw is the exponential race ``argmax(probs / Exponential(1))``: it is scale-invariant (no
renormalisation needed) and lets seeded rows bring their own noise without touching the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pie_workers.wire.batch import GREEDY_TEMPERATURE, SampledLogprobs, Slot, SlotKind, SlotOutput

_USES_TOP_K = {SlotKind.TOP_K, SlotKind.TOP_K_TOP_P}
_USES_TOP_P = {SlotKind.TOP_P, SlotKind.TOP_K_TOP_P}


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` for ascending unique ``rows``, without the full-size copy when they are every row."""
    return t if len(rows) == t.shape[0] else t[rows]


def run_slots(logits: torch.Tensor, slots: Sequence[Slot]) -> list[SlotOutput]:
    """logits: [N, V] float32 rows, ALREADY logit-masked by the caller (disallowed tokens are -inf).

    Row i is evaluated with slots[i]. Returns one SlotOutput per row, in order. Raises ValueError if a
    token sampler's row has no finite logit or a LOGPROBS label is outside the vocab.
    """
    if logits.dim() != 2 or logits.shape[0] != len(slots):
        raise ValueError(f"expected [{len(slots)}, V] logits, got {list(logits.shape)}")
    vocab = logits.shape[1]
    if any(not 0 <= t < vocab for s in slots if s.kind is SlotKind.LOGPROBS for t in s.token_ids):
        raise ValueError(f"logprobs label outside the vocab of {vocab}")
    logits = logits.float()
    out = [SlotOutput() for _ in slots]
    by_kind: dict[str, list[int]] = {"greedy": [], "sampled": [], "reporting": []}
    for i, slot in enumerate(slots):
        key = ("greedy" if slot.is_greedy else "sampled") if slot.kind.is_token else slot.kind
        by_kind.setdefault(key, []).append(i)
        if slot.report_logprobs >= 0 and slot.kind.is_token:
            by_kind["reporting"].append(i)

    # One max over every token row: a row whose max is not finite has NaN / +inf logits and would sample garbage
    # (a mask excluding every token is refused earlier, by the batch plan); greedy rows take its index.
    if token_rows := sorted(by_kind["greedy"] + by_kind["sampled"]):
        maxima = _rows(logits, token_rows).max(dim=-1)  # ~2.5x faster than argmax on a CPU
        finite, argmax = torch.isfinite(maxima.values).tolist(), maxima.indices.tolist()
        if bad := [i for i, ok in zip(token_rows, finite, strict=True) if not ok]:
            raise ValueError(f"rows {bad} have no finite logit (NaN or infinite model output)")
        for i, token in zip(token_rows, argmax, strict=True):
            out[i].token = token  # the sampled rows' are replaced below
    if rows := by_kind["sampled"]:
        tokens = _sample(_rows(logits, rows), [slots[i] for i in rows])
        for i, tok in zip(rows, tokens, strict=True):
            out[i].token = tok
    if rows := by_kind["reporting"]:
        reports = _sampled_logprobs(logits[rows], [out[i].token for i in rows], [slots[i] for i in rows])
        for i, report in zip(rows, reports, strict=True):
            out[i].sampled_logprobs = report
    if rows := by_kind.get(SlotKind.DISTRIBUTION):
        for i, dist in zip(rows, _distributions(logits[rows], [slots[i] for i in rows]), strict=True):
            out[i].distribution = dist
    if rows := by_kind.get(SlotKind.LOGITS):
        host = logits[rows].cpu()
        for j, i in enumerate(rows):
            out[i].logits = host[j].contiguous().numpy().tobytes()
    if rows := by_kind.get(SlotKind.LOGPROBS):
        for i, lp in zip(rows, _logprobs(logits[rows], [slots[i] for i in rows]), strict=True):
            out[i].logprobs = lp
    if rows := by_kind.get(SlotKind.ENTROPY):
        for i, h in zip(rows, _entropy(logits[rows]).tolist(), strict=True):
            out[i].entropy = h
    return out


def _sample(logits: torch.Tensor, slots: list[Slot]) -> list[int]:
    """Draw one token per row (all temperatures above greedy) with each row's filter."""
    n, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([s.temperature for s in slots], device=dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)

    # Neutral values: k=vocab keeps every rank, p=inf keeps every prefix, min_p=0 keeps every prob.
    ks = [min(s.top_k, vocab) if s.kind in _USES_TOP_K and s.top_k > 0 else vocab for s in slots]
    ps = [s.top_p if s.kind in _USES_TOP_P and s.top_p < 1.0 else float("inf") for s in slots]
    sort_rows = [j for j in range(n) if ks[j] < vocab or ps[j] != float("inf")]
    if sort_rows:
        sub = _rows(probs, sort_rows)
        sub = sub.masked_fill(~_rank_filter(sub, [ks[j] for j in sort_rows], [ps[j] for j in sort_rows]), 0.0)
        probs = sub if len(sort_rows) == n else probs.index_copy(0, torch.tensor(sort_rows, device=dev), sub)

    min_ps = [min(max(s.min_p, 0.0), 1.0) if s.kind is SlotKind.MIN_P else 0.0 for s in slots]
    if any(min_ps):
        floor = torch.tensor(min_ps, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)

    noise = torch.empty_like(probs).exponential_()
    for j, s in enumerate(slots):
        if s.seed != 0:
            noise[j].exponential_(generator=torch.Generator(device=dev).manual_seed(s.seed))
    # A zero draw would turn a filtered-out token's 0/0 into NaN; the clamp keeps it at 0.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).max(dim=-1).indices.tolist()


def _rank_filter(probs: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Keep mask for top-k then (renormalised) top-p over rows sorted once by probability.

    Without an active top-p only the first max(k) ranks can survive, so a partial topk replaces the full sort.
    """
    n, vocab = probs.shape
    dev = probs.device
    if all(p == float("inf") for p in ps):
        vals, ids = probs.topk(max(ks), dim=-1)
    else:
        vals, ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vals.shape[1], device=dev)
    in_k = rank < torch.tensor(ks, device=dev)[:, None]
    vals = vals.masked_fill(~in_k, 0.0)
    # Rank j is in the top-p prefix iff the mass strictly before it is below p of the (top-k) total.
    before = vals.cumsum(dim=-1) - vals
    in_p = before < torch.tensor(ps, device=dev)[:, None] * vals.sum(dim=-1, keepdim=True)
    in_p[:, 0] = True
    return torch.zeros(n, vocab, dtype=torch.bool, device=dev).scatter_(1, ids, in_k & in_p)


def _distributions(logits: torch.Tensor, slots: list[Slot]) -> list[tuple[list[int], list[float]]]:
    """Top-k (ids, probs) of softmax(logits / T), descending; k <= 0 means the whole vocab."""
    vocab = logits.shape[1]
    temps = torch.tensor([max(s.temperature, GREEDY_TEMPERATURE) for s in slots], device=logits.device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    ks = [min(s.top_k, vocab) if s.top_k > 0 else vocab for s in slots]
    vals, ids = probs.topk(max(ks), dim=-1)
    vals, ids = vals.tolist(), ids.tolist()
    return [(ids[j][:k], vals[j][:k]) for j, k in enumerate(ks)]


def _sampled_logprobs(logits: torch.Tensor, tokens: list[int], slots: list[Slot]) -> list[SampledLogprobs]:
    """Each row's sampled token's log_softmax and its ``report_logprobs`` most likely alternatives (rows that ask
    for none get empty lists): only the rows that asked pay for the log_softmax."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
    width = min(max(s.report_logprobs for s in slots), logits.shape[1])
    top_vals, top_ids = logp.topk(width, dim=-1) if width > 0 else (logp[:, :0], logp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [
        SampledLogprobs(lp, ids[: s.report_logprobs], vals[: s.report_logprobs])
        for lp, ids, vals, s in zip(chosen, top_ids, top_vals, slots, strict=True)
    ]


def _logprobs(logits: torch.Tensor, slots: list[Slot]) -> list[list[float]]:
    """log_softmax gathered at each row's label ids, in the order given (a masked label gives -inf)."""
    width = max(len(s.token_ids) for s in slots)
    if width == 0:
        return [[] for _ in slots]
    padded = [list(s.token_ids) + [0] * (width - len(s.token_ids)) for s in slots]
    labels = torch.tensor(padded, device=logits.device)
    gathered = torch.log_softmax(logits, dim=-1).gather(1, labels).tolist()
    return [row[: len(s.token_ids)] for row, s in zip(gathered, slots, strict=True)]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits); -inf logits have p = 0 and contribute 0, not NaN."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
