"""Paged attention in Triton over the torch pool's layout (``[pages, page_size, kv_heads, head_dim]`` per layer),
for the torch backend on a GPU: no page is gathered and no padded mask is built, the kernel reads each request's
keys through its row of the block table.

One program attends one tile of one request's query rows for one KV head, with every query head of that KV head's
group folded into the tile's rows, so each K/V tile is loaded once for the whole group. Decode (one row per request)
and prefill (many, the causal mask aligned to the end of the keys) are the same kernel with different tile heights.
Keys are walked in tiles of ``BLOCK_N`` with an online softmax (FlashAttention's), in float32; a tile may span
pages, each key finding its own page, so any page size works. A sliding window bounds the walk from below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pie_workers.batch_plan import PagedRequests

BLOCK_N = 64  # keys per step of the walk
PREFILL_BLOCK_M = 64  # tile rows (query rows x heads of a group) when some request has several query rows
DECODE_BLOCK_M = 16  # the smallest tile tl.dot takes: one decode row holds only a group's heads
NO_WINDOW = 1 << 30  # wider than any sequence; a constant, so that a captured launch holds for every length


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_table_ptr,
    scale_log2, window, page_size,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    request, kv_head, q_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows_per_tile: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_ptr + request)
    num_rows = tl.load(query_start_ptr + request + 1) - q_start
    first_row = q_tile * rows_per_tile
    if first_row >= num_rows:  # past this request's rows (or a request with none)
        return
    seq_len = tl.load(seq_lens_ptr + request)
    context = seq_len - num_rows  # keys before the first query row: query row i sits at key position context + i

    m = tl.arange(0, BLOCK_M)
    row = first_row + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_valid = (row < num_rows) & (m < rows_per_tile * GROUP)
    position = context + row
    d = tl.arange(0, HEAD_DIM_PADDED)
    d_valid = d < HEAD_DIM
    q_offsets = (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    last_position = context + tl.minimum(first_row + rows_per_tile, num_rows) - 1
    kv_begin = tl.maximum(context + first_row - window + 1, 0)  # the first key the window leaves to any row
    kv_end = last_position + 1  # causal: no row of the tile sees past its last row's position
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        key = kv_start + n
        key_valid = key < kv_end
        page = tl.load(block_table_ptr + request * stride_bt + key // page_size, mask=key_valid, other=0)
        page = page.to(tl.int64)  # page * stride overflows int32 in a pool of over 2^31 elements a layer
        slot = key % page_size
        kv_mask = key_valid[:, None] & d_valid[None, :]
        k_offsets = page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :] * stride_kd
        v_offsets = page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd
        k = tl.load(k_ptr + k_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_offsets, mask=kv_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # in log2 units: exp2 below
        behind = position[:, None] - key[None, :]
        scores = tl.where((behind >= 0) & (behind < window), scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # a row that has seen no visible key yet keeps max -inf; subtracting 0 instead keeps exp2 from a NaN
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        p = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    out = acc / row_sum[:, None]  # every real row sees at least its own key
    out_offsets = (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def triton_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pages: torch.Tensor,  # [pages, page_size, Hkv, D] of one layer
    v_pages: torch.Tensor,
    paged: PagedRequests,
    window: int | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns ``[T, Hq * D]`` (into ``out`` when given, its rows contiguous): each request's rows attend causally
    its ``seq_lens`` keys, the last row all of them; with ``window``, key k is visible from position p iff
    p - k < window. Custom masks are not read here (``overwrite_masked_rows`` redoes those rows)."""
    T, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    group = Hq // Hkv
    if out is None:
        out = q.new_empty(T, Hq * D)
    block_m = max(DECODE_BLOCK_M if paged.max_query_len <= 1 else PREFILL_BLOCK_M, triton.next_power_of_2(group))
    rows_per_tile = block_m // group
    grid = (paged.seq_lens.shape[0], Hkv, triton.cdiv(paged.max_query_len, rows_per_tile))
    if T == 0:
        return out
    _paged_attention_kernel[grid](
        q, k_pages, v_pages, out, paged.query_start, paged.seq_lens, paged.block_table,
        scale * 1.4426950408889634,  # log2(e): the kernel exponentiates in base 2
        window or NO_WINDOW,
        k_pages.shape[1],
        *q.stride(), out.stride(0), D,
        *k_pages.stride(), *v_pages.stride(), paged.block_table.stride(0),
        GROUP=group, HEAD_DIM=D, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
    )  # fmt: skip
    return out
