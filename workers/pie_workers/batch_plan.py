"""Turns a ragged ``ForwardBatch`` into the index tensors one forward pass needs, validating every request.

A request that is malformed (token out of vocab, pages that don't cover its KV, bad BRLE, ...) is rejected with a
message naming the problem; the rest of the batch still runs. The plan is built with numpy over the whole batch, and
attention is grouped into a few buckets of similar query length (powers of two) so that padding stays under 2x
while there is no per-request work in the model's hot path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from pie_workers.wire import brle
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot, SlotKind


class BatchError(ValueError):
    """A request (or the batch's page copies) is malformed; the message says what is wrong."""


@dataclass
class AttentionBucket:
    """Requests whose query rows are padded to ``Qb`` and whose KV slots are padded to ``Kb``."""

    q_index: torch.Tensor  # [Rb, Qb] token index of each query row (padding -> 0)
    kv_pages: torch.Tensor  # [Rb, Pb] pool page holding each run of page_size KV positions (padding -> 0)
    mask: torch.Tensor  # [Rb, 1, Qb, Pb * page_size] True = attend
    q_seq: torch.Tensor  # [Rb, 1, Qb, 1] each query's own sequence index (for sliding windows)
    valid: torch.Tensor  # [M] flat (row * Qb + i) indices of real query rows
    dest: torch.Tensor  # [M] token index each real row's output goes to
    identity: bool = False  # the bucket is the whole batch, one unpadded row per request, in token order
    _additive: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The boolean mask restricted to a sliding window of ``window`` tokens (key k visible iff q - k < window)."""
        if window is None:
            return self.mask
        k_seq = torch.arange(self.mask.shape[-1], device=self.mask.device)
        return self.mask & ((self.q_seq - k_seq) < window)

    def additive_mask(self, window: int | None, group: int, dtype: torch.dtype) -> torch.Tensor:
        """0 / -inf mask for query rows ordered (query head in KV group, row), built once per batch and reused by
        every layer. SDPA is fastest with a float mask and with GQA folded into the query rows."""
        key = (window, group, dtype)
        if key not in self._additive:
            allowed = self.mask_for(window)
            rb, _, qb, kb = allowed.shape
            if qb > 1 and group > 1:
                allowed = allowed[:, :, None].expand(rb, 1, group, qb, kb).reshape(rb, 1, group * qb, kb)
            zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self._additive[key] = zeros.masked_fill_(~allowed, float("-inf"))
        return self._additive[key]


@dataclass
class BatchPlan:
    """Everything every tensor-parallel rank needs to run the forward (broadcast from the leader)."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] pool slot each token's K/V is written to
    buckets: list[AttentionBucket]
    logit_rows: torch.Tensor  # [N] token indices whose logits are needed
    copy_src: torch.Tensor  # [C] pool pages copied before the forward
    copy_dst: torch.Tensor  # [C]
    every_row_has_logits: bool = False  # logit_rows == arange(T): decode batches skip the row gather

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def to(self, device: torch.device) -> BatchPlan:
        move = lambda t: t.to(device, non_blocking=True)
        return BatchPlan(
            move(self.token_ids),
            move(self.positions),
            move(self.write_slots),
            [
                AttentionBucket(
                    *(move(t) for t in (b.q_index, b.kv_pages, b.mask, b.q_seq, b.valid, b.dest)), b.identity
                )
                for b in self.buckets
            ],
            move(self.logit_rows),
            move(self.copy_src),
            move(self.copy_dst),
            self.every_row_has_logits,
        )


@dataclass
class RequestSampling:
    """Leader-only: how to turn one request's logit rows into its outputs."""

    index: int  # position of the request in the batch
    slots: list[Slot]  # slot n reads logit row first_row + n
    logit_mask: list[int] | None
    first_row: int  # rows are contiguous per request: its slots', then its drafts'
    num_rows: int
    draft_tokens: list[int] = field(default_factory=list)  # drafts' rows follow the slots' rows
    verify_slot: int = -1  # index into slots of the verifying sampler


@dataclass
class PlannedBatch:
    plan: BatchPlan
    sampling: list[RequestSampling]
    errors: dict[int, str]


def _check_request(req: ForwardRequest, page_size: int, vocab: int) -> str | None:
    """The first structural problem with a request, or None. Per-token checks (ids, positions, page ids) run
    vectorized over the whole batch in ``_check_elements``."""
    n_in, n_draft = len(req.token_ids), len(req.draft_tokens)
    if n_in == 0:
        return "request has no input tokens"
    if len(req.positions) != n_in:
        return f"{len(req.positions)} positions for {n_in} input tokens"
    if len(req.draft_positions) != n_draft:
        return f"{len(req.draft_positions)} draft positions for {n_draft} draft tokens"
    if req.kv_len < 0:
        return f"kv_len {req.kv_len} is negative"
    total = req.kv_len + n_in + n_draft
    need = -(-total // page_size)
    if len(req.page_ids) < need:
        return (
            f"{len(req.page_ids)} KV pages hold {len(req.page_ids) * page_size} tokens but kv_len {req.kv_len} + "
            f"{n_in} inputs + {n_draft} drafts need {total} ({need} pages of {page_size})"
        )
    if req.attention_masks is not None:
        if len(req.attention_masks) != n_in:
            return f"{len(req.attention_masks)} attention-mask rows for {n_in} input tokens"
        visible = req.kv_len + n_in
        for i, row in enumerate(req.attention_masks):
            try:
                brle.validate(row, "attention mask")
            except brle.BrleError as e:
                return f"row {i}: {e}"
            if brle.length(row) > visible:
                return f"malformed attention mask: row {i} covers {brle.length(row)} slots, only {visible} exist"
            if not any(row[1::2]):
                return f"attention mask row {i} attends to nothing"
    if req.logit_mask:
        try:
            brle.validate(req.logit_mask, "logit mask")
        except brle.BrleError as e:
            return str(e)
        if brle.length(req.logit_mask) > vocab:
            return f"malformed logit mask: covers {brle.length(req.logit_mask)} tokens, vocabulary has {vocab}"
    for row, slot in req.slots:
        if not 0 <= row < n_in:
            return f"sampler/probe row {row} is outside the request's {n_in} input rows"
        problem = _check_slot(slot, vocab)
        if problem:
            return problem
    if n_draft:
        token_slots = [row for row, s in req.slots if s.kind.is_token]
        if not token_slots or token_slots[0] != n_in - 1:
            return "draft tokens need a token sampler on the last input row to verify them"
    return None


@functools.lru_cache(maxsize=4096)
def _check_slot(slot: Slot, vocab: int) -> str | None:
    if not isinstance(slot.kind, SlotKind):
        return f"unknown sampler kind {slot.kind!r}"
    if not slot.temperature >= 0:
        return f"temperature {slot.temperature} must be >= 0"
    if slot.top_k < 0:
        return f"top_k {slot.top_k} must be >= 0"
    if not 0.0 < slot.top_p <= 1.0:
        return f"top_p {slot.top_p} must be in (0, 1]"
    if not 0.0 <= slot.min_p <= 1.0:
        return f"min_p {slot.min_p} must be in [0, 1]"
    if slot.kind is SlotKind.LOGPROBS:
        if not slot.token_ids:
            return "logprobs probe needs at least one token id"
        bad = [t for t in slot.token_ids if not 0 <= t < vocab]
        if bad:
            return f"logprobs token id {bad[0]} is out of the vocabulary [0, {vocab})"
    return None


def plan_batch(batch: ForwardBatch, page_size: int, num_pages: int, vocab: int) -> PlannedBatch:
    _check_copies(batch.page_copies, num_pages)
    errors: dict[int, str] = {}
    for i, req in enumerate(batch.requests):
        if problem := _check_request(req, page_size, vocab):
            errors[i] = problem
    ok = [i for i in range(len(batch.requests)) if i not in errors]
    bad = _check_elements([batch.requests[i] for i in ok], page_size, num_pages, vocab)
    if bad:
        errors.update({ok[k]: msg for k, msg in bad.items()})
        ok = [i for i in ok if i not in errors]
    reqs = [batch.requests[i] for i in ok]
    S = page_size

    n_in = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
    n_rows = n_in + np.array([len(r.draft_tokens) for r in reqs], dtype=np.int64)
    kv_len = np.array([r.kv_len for r in reqs], dtype=np.int64)
    total = kv_len + n_rows
    tok_start = np.cumsum(n_rows) - n_rows
    n_pages = np.array([len(r.page_ids) for r in reqs], dtype=np.int64)
    page_start = np.cumsum(n_pages) - n_pages
    pages = np.fromiter((p for r in reqs for p in r.page_ids), dtype=np.int64, count=int(n_pages.sum()))

    token_ids = [t for r in reqs for t in (*r.token_ids, *r.draft_tokens)]
    positions = [p for r in reqs for p in (*r.positions, *r.draft_positions)]
    req_of_tok = np.repeat(np.arange(len(reqs)), n_rows)
    row_of_tok = np.arange(int(n_rows.sum())) - np.repeat(tok_start, n_rows)
    seq_of_tok = kv_len[req_of_tok] + row_of_tok
    write_slots = pages[page_start[req_of_tok] + seq_of_tok // S] * S + seq_of_tok % S

    buckets = []
    bucket_of_req = _pow2_ceil(n_rows)
    for qb in np.unique(bucket_of_req):
        members = np.flatnonzero(bucket_of_req == qb)
        buckets.append(_bucket(members, reqs, n_in, n_rows, kv_len, total, tok_start, page_start, pages, S))

    sampling, logit_rows = _sampling_plan(ok, reqs, n_in, tok_start)
    copy_src, copy_dst = _copy_pages(batch.page_copies)
    plan = BatchPlan(
        token_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        write_slots=torch.from_numpy(write_slots),
        buckets=buckets,
        logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        copy_src=copy_src,
        copy_dst=copy_dst,
        every_row_has_logits=logit_rows == list(range(len(token_ids))),
    )
    return PlannedBatch(plan, sampling, errors)


def _check_elements(reqs: list[ForwardRequest], page_size: int, num_pages: int, vocab: int) -> dict[int, str]:
    """Token ids in the vocabulary, non-negative positions, page ids in the pool and not repeated — for every
    request at once. Returns {index in reqs: problem}."""
    if not reqs:
        return {}
    tokens = np.fromiter((t for r in reqs for t in (*r.token_ids, *r.draft_tokens)), dtype=np.int64)
    positions = np.fromiter((p for r in reqs for p in (*r.positions, *r.draft_positions)), dtype=np.int64)
    rows = np.fromiter((len(r.token_ids) + len(r.draft_tokens) for r in reqs), dtype=np.int64, count=len(reqs))
    need = np.fromiter(
        (-(-(r.kv_len + len(r.token_ids) + len(r.draft_tokens)) // page_size) for r in reqs), np.int64, len(reqs)
    )
    pages = np.fromiter((p for r, n in zip(reqs, need, strict=True) for p in r.page_ids[:n]), dtype=np.int64)
    req_of_tok, req_of_page = np.repeat(np.arange(len(reqs)), rows), np.repeat(np.arange(len(reqs)), need)
    problems: dict[int, str] = {}
    for k in np.unique(req_of_tok[(tokens < 0) | (tokens >= vocab)]):
        bad = next(t for t in (*reqs[k].token_ids, *reqs[k].draft_tokens) if not 0 <= t < vocab)
        problems[int(k)] = f"token id {bad} is out of the vocabulary [0, {vocab})"
    for k in np.unique(req_of_tok[positions < 0]):
        problems.setdefault(int(k), "positions must be non-negative")
    for k in np.unique(req_of_page[(pages < 0) | (pages >= num_pages)]):
        bad = next(p for p in reqs[k].page_ids if not 0 <= p < num_pages)
        problems.setdefault(int(k), f"page id {bad} is out of the KV pool [0, {num_pages})")
    order = np.lexsort((pages, req_of_page))
    repeated = (np.diff(pages[order]) == 0) & (np.diff(req_of_page[order]) == 0)
    for k in np.unique(req_of_page[order][1:][repeated]):
        problems.setdefault(int(k), "page list names the same page twice")
    return problems


def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    return np.left_shift(1, np.ceil(np.log2(np.maximum(x, 1))).astype(np.int64))


def _bucket(members, reqs, n_in, n_rows, kv_len, total, tok_start, page_start, pages, S) -> AttentionBucket:
    rows, ins, kvl, tot = n_rows[members], n_in[members], kv_len[members], total[members]
    qb = int(rows.max())
    pb = int(-(-tot.max() // S))
    kb = pb * S
    i = np.arange(qb)[None, :]
    j = np.arange(kb)[None, None, :]
    real_q = i < rows[:, None]  # [Rb, Qb]
    q_index = np.where(real_q, tok_start[members][:, None] + i, 0)
    n_pages = -(-tot // S)
    real_p = np.arange(pb)[None, :] < n_pages[:, None]
    kv_pages = np.where(real_p, pages[np.minimum(page_start[members][:, None] + np.arange(pb), pages.size - 1)], 0)
    q_seq = np.where(real_q, kvl[:, None] + i, 0)
    mask = (j <= q_seq[:, :, None]) & (j < tot[:, None, None]) & real_q[:, :, None]
    mask[:, :, 0] |= ~real_q  # padded query rows attend slot 0 so softmax stays finite; their output is dropped
    for local, r in enumerate(members):
        rows_brle = reqs[r].attention_masks
        if rows_brle is not None:
            mask[local, : ins[local], :] = brle.decode_rows(rows_brle, kb)
    valid = np.flatnonzero(real_q.reshape(-1))
    dest = q_index.reshape(-1)[valid]
    return AttentionBucket(
        q_index=torch.from_numpy(q_index),
        kv_pages=torch.from_numpy(kv_pages),
        mask=torch.from_numpy(mask[:, None]),
        q_seq=torch.from_numpy(q_seq[:, None, :, None]),
        valid=torch.from_numpy(valid),
        dest=torch.from_numpy(dest),
        identity=qb == 1 and len(members) == len(reqs),
    )


def _sampling_plan(ok: list[int], reqs: list[ForwardRequest], n_in: np.ndarray, tok_start: np.ndarray):
    """One logit row per slot (in slot order), then one per draft to verify; contiguous per request."""
    sampling, logit_rows = [], []
    for k, (idx, req) in enumerate(zip(ok, reqs, strict=True)):
        start, first = int(tok_start[k]), len(logit_rows)
        logit_rows += [start + row for row, _ in req.slots]
        slots = [s for _, s in req.slots]
        rs = RequestSampling(idx, slots, req.logit_mask or None, first, len(slots))
        if req.draft_tokens:
            rs.verify_slot = next(n for n, s in enumerate(slots) if s.kind.is_token)
            rs.draft_tokens = list(req.draft_tokens)
            logit_rows += range(start + int(n_in[k]), start + int(n_in[k]) + len(req.draft_tokens))
            rs.num_rows += len(req.draft_tokens)
        sampling.append(rs)
    return sampling, logit_rows


def _check_copies(copies: list[tuple[int, int]], num_pages: int) -> None:
    for src, dst in copies:
        if not (0 <= src < num_pages and 0 <= dst < num_pages):
            raise BatchError(f"page copy {src} -> {dst} is out of the KV pool [0, {num_pages})")
        if src == dst:
            raise BatchError(f"page copy {src} -> {dst} copies a page onto itself")


def _copy_pages(copies: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    arr = torch.tensor(copies, dtype=torch.long).reshape(-1, 2)
    return arr[:, 0].contiguous(), arr[:, 1].contiguous()
