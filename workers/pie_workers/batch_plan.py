"""Turns a ``ForwardBatch`` into the index tensors one forward pass needs (requests are checked first, in
``batch_checks``; the malformed ones come back as errors and the rest still run).

The plan is built with numpy over the whole batch, and attention is grouped into a few buckets of similar query
length (powers of two) so that padding stays under 2x while there is no per-request work in the model's hot path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from pie_workers.batch_checks import CheckedBatch, FlatRequests, MaskedRows, check_batch
from pie_workers.wire import brle
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot


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

    def to(self, device: torch.device) -> AttentionBucket:
        """A copy on ``device`` (without the additive masks cached here)."""
        move = lambda t: t.to(device, non_blocking=True)
        return AttentionBucket(
            q_index=move(self.q_index),
            kv_pages=move(self.kv_pages),
            mask=move(self.mask),
            q_seq=move(self.q_seq),
            valid=move(self.valid),
            dest=move(self.dest),
            identity=self.identity,
        )

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
class PagedRequests:
    """Each request of the batch as a paged-attention kernel takes it (vLLM's layout of a ragged batch): its rows
    are ``query_start[r]:query_start[r + 1]`` of the batch, it attends ``seq_lens[r]`` slots through the pages of
    ``block_table[r]``, causally by slot. ``masked_rows``: token indices of requests with a custom attention mask,
    which the kernel cannot express (None: there are none), and ``masked_buckets`` the attention buckets holding
    them, which the torch path recomputes."""

    query_start: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max pages] int32 (padding -> 0)
    masked_rows: torch.Tensor | None
    masked_buckets: list[int]
    has_empty_request: bool  # a request with no rows (the kernel wants at least one)
    max_query_len: int = 0  # the longest request's rows and KV slots, known here without a device sync
    max_seq_len: int = 0
    kernel_metadata: dict[int, torch.Tensor] = field(default_factory=dict)  # the CPU kernel's work split, by window

    def to(self, device: torch.device) -> PagedRequests:
        """On a GPU the kernels read these from device memory; CPU kernels read them where they are."""
        if device.type == "cpu":
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return dataclasses.replace(
            self,
            query_start=move(self.query_start),
            seq_lens=move(self.seq_lens),
            block_table=move(self.block_table),
            masked_rows=move(self.masked_rows),
            kernel_metadata={},
        )


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
    paged: PagedRequests | None = None  # when the KV pool's kernels ask for it (plan_batch's paged_requests)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def to(self, device: torch.device) -> BatchPlan:
        move = lambda t: t.to(device, non_blocking=True)
        return BatchPlan(
            token_ids=move(self.token_ids),
            positions=move(self.positions),
            write_slots=move(self.write_slots),
            buckets=[b.to(device) for b in self.buckets],
            logit_rows=move(self.logit_rows),
            copy_src=move(self.copy_src),
            copy_dst=move(self.copy_dst),
            host_moves=self.host_moves,
            every_row_has_logits=self.every_row_has_logits,
            max_position=self.max_position,
            lora_groups=[
                LoraGroup(adapter=g.adapter, zo_seed=g.zo_seed, rows=None if g.rows is None else move(g.rows))
                for g in self.lora_groups
            ],
            paged=None if self.paged is None else self.paged.to(device),
        )


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
    sampling: list[RequestSampling]  # one per valid request, in batch order
    errors: dict[int, str]  # by batch index: why the request was rejected


@dataclass
class _Layout:
    """Where each valid request sits in the flat columns, and how many KV slots it sees during the forward."""

    flat: FlatRequests
    first_token: np.ndarray  # [R] index of the request's first row in flat.token_ids
    first_page: np.ndarray  # [R] index of its first page in flat.page_ids
    kv_total: np.ndarray  # [R] kv_len + rows


def plan_batch(
    batch: ForwardBatch,
    page_size: int,
    num_pages: int,
    vocab: int,
    adapters: Collection[int] = (),
    host_pages: int = 0,
    paged_requests: bool = False,
    kernel_attends_all: bool = False,
) -> PlannedBatch:
    """``adapters``: the ids of the LoRA adapters the runner holds (requests naming another are rejected);
    ``host_pages``: the size of its host buffer; ``paged_requests``: also describe each request for a paged-
    attention kernel (``BatchPlan.paged``); ``kernel_attends_all``: that kernel attends every layer of every
    request it can express, so the torch path's padded buckets are built only for those it cannot (custom masks,
    or all of them in a batch with an empty request). Raises ``BatchError`` for malformed page copies or host
    moves."""
    checked = check_batch(batch, page_size, num_pages, vocab, adapters, host_pages)
    flat, requests = checked.flat, checked.requests
    layout = _Layout(
        flat=flat,
        first_token=np.cumsum(flat.num_rows) - flat.num_rows,
        first_page=np.cumsum(flat.num_pages) - flat.num_pages,
        kv_total=flat.kv_len + flat.num_rows,
    )

    request_of_token = np.repeat(np.arange(len(requests)), flat.num_rows)
    kv_position = (
        flat.kv_len[request_of_token] + np.arange(request_of_token.size) - layout.first_token[request_of_token]
    )
    page_of_token = flat.page_ids[layout.first_page[request_of_token] + kv_position // page_size]
    write_slots = page_of_token * page_size + kv_position % page_size

    if flat.num_rows.size and flat.num_rows.max() == flat.num_rows.min():  # e.g. pure decode: one bucket
        bucket_members = [np.arange(len(requests))]
    else:
        query_len_of_request = _next_power_of_two(flat.num_rows)
        bucket_members = [np.flatnonzero(query_len_of_request == q) for q in np.unique(query_len_of_request)]
    if paged_requests and kernel_attends_all and flat.num_rows.size and flat.num_rows.min() > 0:
        masked = [k for k, request in enumerate(requests) if request.attention_masks is not None]
        bucket_members = [members for members in bucket_members if np.isin(members, masked).any()]
    buckets = [_attention_bucket(members, requests, layout, page_size) for members in bucket_members]

    sampling, logit_rows = _sampling_plan(checked, layout.first_token)
    copy_src, copy_dst = _pair_columns(batch.page_copies)
    plan = BatchPlan(
        token_ids=torch.from_numpy(flat.token_ids),
        positions=torch.from_numpy(flat.positions),
        write_slots=torch.from_numpy(write_slots),
        buckets=buckets,
        logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        copy_src=copy_src,
        copy_dst=copy_dst,
        host_moves=_host_moves(batch),
        every_row_has_logits=logit_rows == list(range(flat.token_ids.size)),
        max_position=int(flat.positions.max()) if flat.positions.size else 0,
        lora_groups=_lora_groups(requests, layout),
        paged=_paged_requests(requests, layout, bucket_members) if paged_requests else None,
    )
    return PlannedBatch(plan=plan, sampling=sampling, errors=checked.errors)


def _paged_requests(requests: list[ForwardRequest], layout: _Layout, buckets: list[np.ndarray]) -> PagedRequests:
    flat = layout.flat
    width = int(flat.num_pages.max()) if flat.num_pages.size else 0
    column = np.arange(width)[None, :]
    real_page = column < flat.num_pages[:, None]
    block_table = np.where(real_page, flat.page_ids[np.where(real_page, layout.first_page[:, None] + column, 0)], 0)
    masked = [k for k, req in enumerate(requests) if req.attention_masks is not None]
    masked_rows = None
    if masked:
        rows = [np.arange(layout.first_token[k], layout.first_token[k] + flat.num_rows[k]) for k in masked]
        masked_rows = torch.from_numpy(np.concatenate(rows))
    return PagedRequests(
        query_start=torch.from_numpy(np.concatenate([[0], np.cumsum(flat.num_rows)]).astype(np.int32)),
        seq_lens=torch.from_numpy(layout.kv_total.astype(np.int32)),
        block_table=torch.from_numpy(block_table.astype(np.int32)),
        masked_rows=masked_rows,
        masked_buckets=[b for b, members in enumerate(buckets) if np.isin(members, masked).any()],
        has_empty_request=bool(flat.num_rows.size and flat.num_rows.min() == 0),
        max_query_len=int(flat.num_rows.max()) if flat.num_rows.size else 0,
        max_seq_len=int(layout.kv_total.max()) if layout.kv_total.size else 0,
    )


def _next_power_of_two(x: np.ndarray) -> np.ndarray:
    return np.left_shift(1, np.ceil(np.log2(np.maximum(x, 1))).astype(np.int64))


def _attention_bucket(
    members: np.ndarray, requests: list[ForwardRequest], layout: _Layout, page_size: int
) -> AttentionBucket:
    """The requests ``members`` (indices into ``requests``) padded to their longest query and page list."""
    flat = layout.flat
    num_rows, num_inputs, kv_len = flat.num_rows[members], flat.num_inputs[members], flat.kv_len[members]
    num_pages = flat.num_pages[members]
    query_len = int(num_rows.max())
    pages_per_request = int(num_pages.max())
    kv_slots = pages_per_request * page_size
    query = np.arange(query_len)[None, :]
    kv_slot = np.arange(kv_slots)[None, None, :]
    real_query = query < num_rows[:, None]  # [Rb, Qb]
    q_index = np.where(real_query, layout.first_token[members][:, None] + query, 0)
    real_page = np.arange(pages_per_request)[None, :] < num_pages[:, None]
    page_index = np.where(real_page, layout.first_page[members][:, None] + np.arange(pages_per_request), 0)
    kv_pages = np.where(real_page, flat.page_ids[page_index], 0)
    q_seq = np.where(real_query, kv_len[:, None] + query, 0)
    mask = (kv_slot <= q_seq[:, :, None]) & (kv_slot < layout.kv_total[members][:, None, None]) & real_query[:, :, None]
    mask[:, :, 0] |= ~real_query  # padded query rows attend slot 0 so softmax stays finite; their output is dropped
    for local, r in enumerate(members):
        attention_masks = requests[r].attention_masks
        if attention_masks is not None:
            mask[local, : num_inputs[local], :] = brle.decode_rows(attention_masks, kv_slots)
    valid = np.flatnonzero(real_query.reshape(-1))
    dest = q_index.reshape(-1)[valid]
    return AttentionBucket(
        q_index=torch.from_numpy(q_index),
        kv_pages=torch.from_numpy(kv_pages),
        mask=torch.from_numpy(mask[:, None]),
        q_seq=torch.from_numpy(q_seq[:, None, :, None]),
        valid=torch.from_numpy(valid),
        dest=torch.from_numpy(dest),
        identity=query_len == 1 and len(members) == len(requests),
    )


def _sampling_plan(checked: CheckedBatch, first_token: np.ndarray) -> tuple[list[RequestSampling], list[int]]:
    """One logit row per slot (in slot order), then one per draft to verify; contiguous per request. Returns the
    sampling of each valid request and the token index of every logit row."""
    sampling, logit_rows = [], []
    num_inputs = checked.flat.num_inputs
    for k, (index, req) in enumerate(zip(checked.batch_indices, checked.requests, strict=True)):
        start, first_row = int(first_token[k]), len(logit_rows)
        logit_rows += [start + row for row, _ in req.slots]
        slots = [s for _, s in req.slots]
        rs = RequestSampling(index, slots, first_row, len(slots), masked_rows=checked.masked_rows[index])
        if req.draft_tokens:
            rs.verify_slot = next(n for n, s in enumerate(slots) if s.kind.is_token)
            rs.draft_tokens = list(req.draft_tokens)
            first_draft = start + int(num_inputs[k])
            logit_rows += range(first_draft, first_draft + len(req.draft_tokens))
            rs.num_rows += len(req.draft_tokens)
        sampling.append(rs)
    return sampling, logit_rows


def _lora_groups(requests: list[ForwardRequest], layout: _Layout) -> list[LoraGroup]:
    """Requests grouped by (adapter, zo seed); requests without an adapter belong to no group."""
    members: dict[tuple[int, int | None], list[int]] = {}
    for k, req in enumerate(requests):
        if req.adapter is not None:
            members.setdefault((req.adapter, req.zo_seed), []).append(k)
    first_token, num_rows = layout.first_token, layout.flat.num_rows
    groups = []
    for (adapter, seed), ks in members.items():
        rows = None
        if len(ks) < len(requests):
            rows = torch.from_numpy(
                np.concatenate([np.arange(first_token[k], first_token[k] + num_rows[k]) for k in ks])
            )
        groups.append(LoraGroup(adapter=adapter, zo_seed=seed, rows=rows))
    return groups


def _host_moves(batch: ForwardBatch) -> HostMoves | None:
    """Offloads are (pool page, host slot) pairs, restores (host slot, pool page); both checked already."""
    if not batch.offloads and not batch.restores:
        return None
    offload_pages, offload_slots = _pair_columns(batch.offloads)
    restore_slots, restore_pages = _pair_columns(batch.restores)
    return HostMoves(
        offload_pages=offload_pages,
        offload_slots=offload_slots,
        restore_slots=restore_slots,
        restore_pages=restore_pages,
    )


def _pair_columns(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the second element of every pair, as two long tensors."""
    arr = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
    return arr[:, 0].contiguous(), arr[:, 1].contiguous()
