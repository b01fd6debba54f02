"""Turns a ragged ``ForwardBatch`` into the index tensors one forward pass needs, validating every request.

A request that is malformed (token out of vocab, pages that don't cover its KV, bad BRLE, ...) is rejected with a
message naming the problem; the rest of the batch still runs. The plan is built with numpy over the whole batch, and
attention is grouped into a few buckets of similar query length (powers of two) so that padding stays under 2x
while there is no per-request work in the model's hot path.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from pie_workers import logit_masks
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
class LoraGroup:
    """The token rows of the requests that use one adapter under one zo seed (or none)."""

    adapter: int
    zo_seed: int | None
    rows: torch.Tensor | None  # [n] token indices; None: every row of the batch


@dataclass
class HostMoves:
    """Pages copied to host memory and back; indices stay on the CPU (the host buffer lives there)."""

    offload_pages: torch.Tensor  # [O] pool pages ...
    offload_slots: torch.Tensor  # [O] ... copied to these host slots
    restore_slots: torch.Tensor  # [R] host slots ...
    restore_pages: torch.Tensor  # [R] ... copied back into these pool pages


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
    host_moves: HostMoves | None = None  # offloads to and restores from host memory, before the copies
    every_row_has_logits: bool = False  # logit_rows == arange(T): decode batches skip the row gather
    max_position: int = 0  # largest RoPE position in the batch (sizes the rotary table without a device sync)
    lora_groups: list[LoraGroup] = field(default_factory=list)  # empty: no request uses an adapter

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
            self.host_moves,
            self.every_row_has_logits,
            self.max_position,
            [LoraGroup(g.adapter, g.zo_seed, None if g.rows is None else move(g.rows)) for g in self.lora_groups],
        )


@dataclass(frozen=True)
class MaskedRows:
    """Logit rows ``[first, first + count)`` of one request (0: its first logit row) and the penalty a logit mask
    adds to each (0 where allowed, -inf where not). Expanded while the plan checks the mask, so applying it after
    the forward is one add (several times cheaper than ``masked_fill_`` on the CPU)."""

    first: int
    count: int
    penalty: torch.Tensor  # [vocab] float32


@dataclass
class RequestSampling:
    """Leader-only: how to turn one request's logit rows into its outputs."""

    index: int  # position of the request in the batch
    slots: list[Slot]  # slot n reads logit row first_row + n
    first_row: int  # rows are contiguous per request: its slots', then its drafts'
    num_rows: int
    draft_tokens: list[int] = field(default_factory=list)  # drafts' rows follow the slots' rows
    verify_slot: int = -1  # index into slots of the verifying sampler
    masked_rows: list[MaskedRows] = field(default_factory=list)  # empty: every row unrestricted


@dataclass
class PlannedBatch:
    plan: BatchPlan
    sampling: list[RequestSampling]
    errors: dict[int, str]


def _check_request(req: ForwardRequest, page_size: int, vocab: int, adapters: Collection[int]) -> str | None:
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
    for row, slot in req.slots:
        if not 0 <= row < n_in:
            return f"sampler/probe row {row} is outside the request's {n_in} input rows"
        problem = _check_slot(slot, vocab)
        if problem:
            return problem
    if req.draft_masks is not None and len(req.draft_masks) != n_draft:
        return f"{len(req.draft_masks)} draft masks for {n_draft} draft tokens"
    if n_draft:
        token_slots = [row for row, s in req.slots if s.kind.is_token]
        if not token_slots or token_slots[0] != n_in - 1:
            return "draft tokens need a token sampler on the last input row to verify them"
    if req.adapter is not None and req.adapter not in adapters:
        return f"adapter {req.adapter} does not exist on this replica"
    if req.zo_seed is not None and req.adapter is None:
        return "a zo seed perturbs an adapter: the request names none"
    return None


def _masked_rows(req: ForwardRequest, vocab: int) -> list[MaskedRows] | str:
    """The request's logit masks over its logit rows (its slots', then its drafts'), each checked once; or what is
    wrong with one. ``logit_mask`` covers every row, or only the slot rows when ``draft_masks`` gives each draft row
    its own (``[]``: unrestricted). A mask over rows a token is sampled from must allow one: decided here from the
    runs, so no masked row reaches the samplers with every logit at -inf."""
    n_slots, n_draft = len(req.slots), len(req.draft_tokens)
    spans = []
    if req.logit_mask is not None and len(req.logit_mask):
        spans.append((0, n_slots + n_draft if req.draft_masks is None else n_slots, req.logit_mask, "logit mask"))
    spans += [(n_slots + i, 1, m, f"draft mask {i}") for i, m in enumerate(req.draft_masks or ()) if len(m)]
    if not spans:
        return []
    samples_tokens = any(s.kind.is_token for _, s in req.slots)
    rows = []
    for first, count, mask, what in spans:
        try:
            expanded = logit_masks.expand(mask, vocab, what)
        except brle.BrleError as e:
            return str(e)
        if samples_tokens and not expanded.allows_any:
            return f"the {what} excludes every token"
        rows.append(MaskedRows(first, count, expanded.penalty))
    return rows


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


def plan_batch(
    batch: ForwardBatch,
    page_size: int,
    num_pages: int,
    vocab: int,
    adapters: Collection[int] = (),
    host_pages: int = 0,
) -> PlannedBatch:
    """``adapters``: the ids of the LoRA adapters the runner holds (requests naming another are rejected);
    ``host_pages``: the size of its host buffer."""
    _check_copies(batch.page_copies, num_pages)
    host_moves = _host_moves(batch, num_pages, host_pages)
    errors: dict[int, str] = {}
    masked_rows: dict[int, list[MaskedRows]] = {}
    for i, req in enumerate(batch.requests):
        checked = _check_request(req, page_size, vocab, adapters) or _masked_rows(req, vocab)
        if isinstance(checked, str):
            errors[i] = checked
        else:
            masked_rows[i] = checked
    ok = [i for i in range(len(batch.requests)) if i not in errors]
    reqs = [batch.requests[i] for i in ok]
    cols = _Columns.of(reqs, page_size)
    if bad := cols.problems(reqs, num_pages, vocab):
        errors.update({ok[k]: msg for k, msg in bad.items()})
        keep = np.array([k not in bad for k in range(len(reqs))])
        cols = cols.select(keep)
        ok = [i for k, i in enumerate(ok) if keep[k]]
        reqs = [batch.requests[i] for i in ok]
    S = page_size

    total = cols.kv_len + cols.n_rows
    tok_start = np.cumsum(cols.n_rows) - cols.n_rows
    page_start = np.cumsum(cols.n_pages) - cols.n_pages
    req_of_tok = np.repeat(np.arange(len(reqs)), cols.n_rows)
    seq_of_tok = cols.kv_len[req_of_tok] + np.arange(req_of_tok.size) - tok_start[req_of_tok]
    write_slots = cols.pages[page_start[req_of_tok] + seq_of_tok // S] * S + seq_of_tok % S

    if cols.n_rows.size and cols.n_rows.max() == cols.n_rows.min():  # e.g. pure decode: one bucket
        groups = [np.arange(len(reqs))]
    else:
        bucket_of_req = _pow2_ceil(cols.n_rows)
        groups = [np.flatnonzero(bucket_of_req == qb) for qb in np.unique(bucket_of_req)]
    buckets = [_bucket(members, reqs, cols, total, tok_start, page_start, S) for members in groups]

    sampling, logit_rows = _sampling_plan(ok, reqs, cols.n_in, tok_start, masked_rows)
    copy_src, copy_dst = _copy_pages(batch.page_copies)
    plan = BatchPlan(
        token_ids=torch.from_numpy(cols.tokens),
        positions=torch.from_numpy(cols.positions),
        write_slots=torch.from_numpy(write_slots),
        buckets=buckets,
        logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        copy_src=copy_src,
        copy_dst=copy_dst,
        host_moves=host_moves,
        every_row_has_logits=logit_rows == list(range(cols.tokens.size)),
        max_position=int(cols.positions.max()) if cols.positions.size else 0,
        lora_groups=_lora_groups(reqs, cols.n_rows, tok_start),
    )
    return PlannedBatch(plan, sampling, errors)


@dataclass
class _Columns:
    """The batch flattened once: per-request lengths, then every row's token/position and every used page."""

    n_in: np.ndarray
    n_rows: np.ndarray  # inputs + drafts
    kv_len: np.ndarray
    n_pages: np.ndarray  # pages each request actually uses
    tokens: np.ndarray
    positions: np.ndarray
    pages: np.ndarray

    @staticmethod
    def of(reqs: list[ForwardRequest], page_size: int) -> _Columns:
        chain = itertools.chain.from_iterable
        n_in = np.fromiter((len(r.token_ids) for r in reqs), np.int64, len(reqs))
        n_rows = n_in + np.fromiter((len(r.draft_tokens) for r in reqs), np.int64, len(reqs))
        kv_len = np.fromiter((r.kv_len for r in reqs), np.int64, len(reqs))
        n_pages = -(-(kv_len + n_rows) // page_size)
        return _Columns(
            n_in,
            n_rows,
            kv_len,
            n_pages,
            np.fromiter(chain(chain((r.token_ids, r.draft_tokens)) for r in reqs), np.int64, int(n_rows.sum())),
            np.fromiter(chain(chain((r.positions, r.draft_positions)) for r in reqs), np.int64, int(n_rows.sum())),
            np.fromiter(chain(r.page_ids[:n] for r, n in zip(reqs, n_pages.tolist(), strict=True)), np.int64),
        )

    def problems(self, reqs: list[ForwardRequest], num_pages: int, vocab: int) -> dict[int, str]:
        """Token ids in the vocabulary, non-negative positions, page ids in the pool and not repeated — checked for
        every request at once (a few reductions when all is well). Returns {index in reqs: problem}."""
        tokens, positions, pages = self.tokens, self.positions, self.pages
        req_of_page = np.repeat(np.arange(len(reqs)), self.n_pages)
        page_keys = req_of_page * num_pages + pages
        if (
            (tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < vocab and positions.min() >= 0))
            and (pages.size == 0 or (pages.min() >= 0 and pages.max() < num_pages))
            and np.unique(page_keys).size == pages.size
        ):
            return {}
        req_of_tok = np.repeat(np.arange(len(reqs)), self.n_rows)
        found: dict[int, str] = {}
        for k in np.unique(req_of_tok[(tokens < 0) | (tokens >= vocab)]).tolist():
            bad = next(t for t in (*reqs[k].token_ids, *reqs[k].draft_tokens) if not 0 <= t < vocab)
            found[k] = f"token id {bad} is out of the vocabulary [0, {vocab})"
        for k in np.unique(req_of_tok[positions < 0]).tolist():
            found.setdefault(k, "positions must be non-negative")
        for k in np.unique(req_of_page[(pages < 0) | (pages >= num_pages)]).tolist():
            bad = next(p for p in reqs[k].page_ids if not 0 <= p < num_pages)
            found.setdefault(k, f"page id {bad} is out of the KV pool [0, {num_pages})")
        order = np.lexsort((pages, req_of_page))
        repeated = (np.diff(pages[order]) == 0) & (np.diff(req_of_page[order]) == 0)
        for k in np.unique(req_of_page[order][1:][repeated]).tolist():
            found.setdefault(k, "page list names the same page twice")
        return found

    def select(self, keep: np.ndarray) -> _Columns:
        rows, pages = np.repeat(keep, self.n_rows), np.repeat(keep, self.n_pages)
        return _Columns(
            self.n_in[keep],
            self.n_rows[keep],
            self.kv_len[keep],
            self.n_pages[keep],
            self.tokens[rows],
            self.positions[rows],
            self.pages[pages],
        )


def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    return np.left_shift(1, np.ceil(np.log2(np.maximum(x, 1))).astype(np.int64))


def _bucket(members, reqs, cols: _Columns, total, tok_start, page_start, S) -> AttentionBucket:
    rows, ins, kvl, tot = cols.n_rows[members], cols.n_in[members], cols.kv_len[members], total[members]
    qb = int(rows.max())
    pb = int(cols.n_pages[members].max())
    kb = pb * S
    i = np.arange(qb)[None, :]
    j = np.arange(kb)[None, None, :]
    real_q = i < rows[:, None]  # [Rb, Qb]
    q_index = np.where(real_q, tok_start[members][:, None] + i, 0)
    real_p = np.arange(pb)[None, :] < cols.n_pages[members][:, None]
    page_index = np.where(real_p, page_start[members][:, None] + np.arange(pb), 0)
    kv_pages = np.where(real_p, cols.pages[page_index], 0)
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


def _sampling_plan(
    ok: list[int],
    reqs: list[ForwardRequest],
    n_in: np.ndarray,
    tok_start: np.ndarray,
    masked_rows: dict[int, list[MaskedRows]],
):
    """One logit row per slot (in slot order), then one per draft to verify; contiguous per request."""
    sampling, logit_rows = [], []
    for k, (idx, req) in enumerate(zip(ok, reqs, strict=True)):
        start, first = int(tok_start[k]), len(logit_rows)
        logit_rows += [start + row for row, _ in req.slots]
        slots = [s for _, s in req.slots]
        rs = RequestSampling(idx, slots, first, len(slots), masked_rows=masked_rows[idx])
        if req.draft_tokens:
            rs.verify_slot = next(n for n, s in enumerate(slots) if s.kind.is_token)
            rs.draft_tokens = list(req.draft_tokens)
            logit_rows += range(start + int(n_in[k]), start + int(n_in[k]) + len(req.draft_tokens))
            rs.num_rows += len(req.draft_tokens)
        sampling.append(rs)
    return sampling, logit_rows


def _lora_groups(reqs: list[ForwardRequest], n_rows: np.ndarray, tok_start: np.ndarray) -> list[LoraGroup]:
    """Requests grouped by (adapter, zo seed); requests without an adapter belong to no group."""
    members: dict[tuple[int, int | None], list[int]] = {}
    for k, req in enumerate(reqs):
        if req.adapter is not None:
            members.setdefault((req.adapter, req.zo_seed), []).append(k)
    groups = []
    for (adapter, seed), ks in members.items():
        rows = None
        if len(ks) < len(reqs):
            rows = torch.from_numpy(np.concatenate([np.arange(tok_start[k], tok_start[k] + n_rows[k]) for k in ks]))
        groups.append(LoraGroup(adapter, seed, rows))
    return groups


def _check_copies(copies: list[tuple[int, int]], num_pages: int) -> None:
    for src, dst in copies:
        if not (0 <= src < num_pages and 0 <= dst < num_pages):
            raise BatchError(f"page copy {src} -> {dst} is out of the KV pool [0, {num_pages})")
        if src == dst:
            raise BatchError(f"page copy {src} -> {dst} copies a page onto itself")


def _host_moves(batch: ForwardBatch, num_pages: int, host_pages: int) -> HostMoves | None:
    if not batch.offloads and not batch.restores:
        return None
    for what, pairs, (pages, slots) in (("offload", batch.offloads, (0, 1)), ("restore", batch.restores, (1, 0))):
        for pair in pairs:
            if not (0 <= pair[pages] < num_pages and 0 <= pair[slots] < host_pages):
                raise BatchError(
                    f"{what} {pair} is out of the KV pool [0, {num_pages}) or host buffer [0, {host_pages})"
                )
    offload_pages, offload_slots = _copy_pages(batch.offloads)
    restore_slots, restore_pages = _copy_pages(batch.restores)
    return HostMoves(offload_pages, offload_slots, restore_slots, restore_pages)


def _copy_pages(copies: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    arr = torch.tensor(copies, dtype=torch.long).reshape(-1, 2)
    return arr[:, 0].contiguous(), arr[:, 1].contiguous()
