"""Validation of a ``ForwardBatch`` before it is planned.

A malformed request (token out of vocab, pages that don't cover its KV, bad BRLE, ...) is rejected with a message
naming the problem, and the rest of the batch still runs; malformed page copies or host moves belong to the whole
batch and raise ``BatchError``. Per-token checks run vectorized over the flattened batch, which the planner then
reuses, so a well-formed batch costs a few numpy reductions.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from pie_workers import logit_masks
from pie_workers.wire import brle
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot, SlotKind
from pie_workers.wire.pages import pages_for


class BatchError(ValueError):
    """A request (or the batch's page copies) is malformed; the message says what is wrong."""


@dataclass(frozen=True)
class MaskedRows:
    """Logit rows ``[first, first + count)`` of one request (0: its first logit row) and the penalty a logit mask
    adds to each (0 where allowed, -inf where not). Expanded while the mask is checked, so applying it after the
    forward is one add (several times cheaper than ``masked_fill_`` on the CPU)."""

    first: int
    count: int
    penalty: torch.Tensor  # [vocab] float32


@dataclass
class FlatRequests:
    """Requests flattened once into numpy columns: per-request lengths, then every row's token and position and
    every page the request uses, request after request. Checked here, indexed by the planner."""

    num_inputs: np.ndarray  # [R] input tokens of each request
    num_rows: np.ndarray  # [R] inputs + drafts: the query rows each request adds to the forward
    kv_len: np.ndarray  # [R] KV positions already cached before the forward
    num_pages: np.ndarray  # [R] pages each request actually uses (its page list may be longer)
    token_ids: np.ndarray  # [T] inputs, then drafts, of each request
    positions: np.ndarray  # [T]
    page_ids: np.ndarray  # [sum(num_pages)]

    @staticmethod
    def of(requests: list[ForwardRequest], page_size: int) -> FlatRequests:
        chain = itertools.chain.from_iterable
        count = len(requests)
        num_inputs = np.fromiter((len(r.token_ids) for r in requests), np.int64, count)
        num_rows = num_inputs + np.fromiter((len(r.draft_tokens) for r in requests), np.int64, count)
        kv_len = np.fromiter((r.kv_len for r in requests), np.int64, count)
        num_pages = pages_for(kv_len + num_rows, page_size)
        total_rows = int(num_rows.sum())
        return FlatRequests(
            num_inputs=num_inputs,
            num_rows=num_rows,
            kv_len=kv_len,
            num_pages=num_pages,
            token_ids=np.fromiter(chain(chain((r.token_ids, r.draft_tokens)) for r in requests), np.int64, total_rows),
            positions=np.fromiter(
                chain(chain((r.positions, r.draft_positions)) for r in requests), np.int64, total_rows
            ),
            page_ids=np.fromiter(
                chain(r.page_ids[:n] for r, n in zip(requests, num_pages.tolist(), strict=True)), np.int64
            ),
        )

    def select(self, keep: np.ndarray) -> FlatRequests:
        """Only the requests where ``keep`` (a boolean per request) is true."""
        keep_rows, keep_pages = np.repeat(keep, self.num_rows), np.repeat(keep, self.num_pages)
        return FlatRequests(
            num_inputs=self.num_inputs[keep],
            num_rows=self.num_rows[keep],
            kv_len=self.kv_len[keep],
            num_pages=self.num_pages[keep],
            token_ids=self.token_ids[keep_rows],
            positions=self.positions[keep_rows],
            page_ids=self.page_ids[keep_pages],
        )


@dataclass
class CheckedBatch:
    """The requests that passed every check (in batch order, flattened) and what is wrong with the others."""

    batch_indices: list[int]  # position in the batch of each valid request
    requests: list[ForwardRequest]  # the valid requests
    flat: FlatRequests  # the valid requests, flattened
    masked_rows: dict[int, list[MaskedRows]]  # by batch index; empty list: every row unrestricted
    errors: dict[int, str]  # by batch index: why the request was rejected


def check_batch(
    batch: ForwardBatch,
    page_size: int,
    num_pages: int,
    vocab: int,
    adapters: Collection[int],
    host_pages: int,
) -> CheckedBatch:
    """Raises ``BatchError`` for malformed page copies or host moves; a malformed request only lands in ``errors``.
    ``adapters``: the ids of the LoRA adapters the runner holds; ``host_pages``: the size of its host buffer."""
    check_page_copies(batch.page_copies, num_pages)
    check_host_moves(batch, num_pages, host_pages)
    errors: dict[int, str] = {}
    masked_rows: dict[int, list[MaskedRows]] = {}
    for i, req in enumerate(batch.requests):
        checked = _request_problem(req, page_size, vocab, adapters) or _logit_mask_rows(req, vocab)
        if isinstance(checked, str):
            errors[i] = checked
        else:
            masked_rows[i] = checked
    batch_indices = [i for i in range(len(batch.requests)) if i not in errors]
    requests = [batch.requests[i] for i in batch_indices]
    flat = FlatRequests.of(requests, page_size)
    if element_errors := _element_problems(flat, requests, num_pages, vocab):
        errors.update({batch_indices[k]: msg for k, msg in element_errors.items()})
        keep = np.array([k not in element_errors for k in range(len(requests))])
        flat = flat.select(keep)
        batch_indices = [i for k, i in enumerate(batch_indices) if keep[k]]
        requests = [batch.requests[i] for i in batch_indices]
    return CheckedBatch(batch_indices, requests, flat, masked_rows, errors)


def check_page_copies(copies: list[tuple[int, int]], num_pages: int) -> None:
    for src, dst in copies:
        if not (0 <= src < num_pages and 0 <= dst < num_pages):
            raise BatchError(f"page copy {src} -> {dst} is out of the KV pool [0, {num_pages})")
        if src == dst:
            raise BatchError(f"page copy {src} -> {dst} copies a page onto itself")


def check_host_moves(batch: ForwardBatch, num_pages: int, host_pages: int) -> None:
    """Offloads are (pool page, host slot) pairs, restores (host slot, pool page)."""
    for what, pairs, (page_at, slot_at) in (("offload", batch.offloads, (0, 1)), ("restore", batch.restores, (1, 0))):
        for pair in pairs:
            if not (0 <= pair[page_at] < num_pages and 0 <= pair[slot_at] < host_pages):
                raise BatchError(
                    f"{what} {pair} is out of the KV pool [0, {num_pages}) or host buffer [0, {host_pages})"
                )


def _request_problem(req: ForwardRequest, page_size: int, vocab: int, adapters: Collection[int]) -> str | None:
    """The first structural problem with a request, or None. Per-token checks (ids, positions, page ids) run
    vectorized over the whole batch in ``_element_problems``."""
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
    need = pages_for(total, page_size)
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
        problem = _slot_problem(slot, vocab)
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


def _logit_mask_rows(req: ForwardRequest, vocab: int) -> list[MaskedRows] | str:
    """The request's logit masks over its logit rows (its slots', then its drafts'), each checked once; or what is
    wrong with one. ``logit_mask`` covers every row, or only the slot rows when ``draft_masks`` gives each draft row
    its own (``[]``: unrestricted). A mask over rows a token is sampled from must allow one: decided here from the
    runs, so no masked row reaches the samplers with every logit at -inf."""
    n_slots, n_draft = len(req.slots), len(req.draft_tokens)
    spans = []  # (first row, row count, BRLE mask, its name in errors)
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
        rows.append(MaskedRows(first=first, count=count, penalty=expanded.penalty))
    return rows


@functools.lru_cache(maxsize=4096)
def _slot_problem(slot: Slot, vocab: int) -> str | None:
    """Cached: a generation repeats the same few samplers step after step."""
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


def _element_problems(flat: FlatRequests, requests: list[ForwardRequest], num_pages: int, vocab: int) -> dict[int, str]:
    """Token ids in the vocabulary, non-negative positions, page ids in the pool and not repeated — checked for
    every request at once (a few reductions when all is well). Returns {index in requests: problem}."""
    tokens, positions, pages = flat.token_ids, flat.positions, flat.page_ids
    request_of_page = np.repeat(np.arange(len(requests)), flat.num_pages)
    page_keys = request_of_page * num_pages + pages
    if (
        (tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < vocab and positions.min() >= 0))
        and (pages.size == 0 or (pages.min() >= 0 and pages.max() < num_pages))
        and np.unique(page_keys).size == pages.size
    ):
        return {}
    request_of_token = np.repeat(np.arange(len(requests)), flat.num_rows)
    found: dict[int, str] = {}
    for k in np.unique(request_of_token[(tokens < 0) | (tokens >= vocab)]).tolist():
        bad = next(t for t in (*requests[k].token_ids, *requests[k].draft_tokens) if not 0 <= t < vocab)
        found[k] = f"token id {bad} is out of the vocabulary [0, {vocab})"
    for k in np.unique(request_of_token[positions < 0]).tolist():
        found.setdefault(k, "positions must be non-negative")
    for k in np.unique(request_of_page[(pages < 0) | (pages >= num_pages)]).tolist():
        bad = next(p for p in requests[k].page_ids if not 0 <= p < num_pages)
        found.setdefault(k, f"page id {bad} is out of the KV pool [0, {num_pages})")
    order = np.lexsort((pages, request_of_page))
    repeated = (np.diff(pages[order]) == 0) & (np.diff(request_of_page[order]) == 0)
    for k in np.unique(request_of_page[order][1:][repeated]).tolist():
        found.setdefault(k, "page list names the same page twice")
    return found
