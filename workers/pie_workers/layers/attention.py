"""Attention over the paged KV pool for a ragged batch, one SDPA call per query-length bucket."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pie_workers.batch_plan import BatchPlan


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [slots, Hkv, D] of one layer
    v_pool: torch.Tensor,
    plan: BatchPlan,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Returns ``[T, Hq * D]``. Each bucket gathers its requests' queries and KV pages into padded tensors."""
    T, Hq, D = q.shape
    out = q.new_empty(T, Hq * D)
    gqa = Hq != k_pool.shape[1]
    for b in plan.buckets:
        rb, qb = b.q_index.shape
        qs = q[b.q_index].transpose(1, 2)  # [Rb, Hq, Qb, D]
        ks = k_pool[b.kv_slots].transpose(1, 2)  # [Rb, Hkv, Kb, D]
        vs = v_pool[b.kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=b.mask_for(window), scale=scale, enable_gqa=gqa)
        out[b.dest] = o.transpose(1, 2).reshape(rb * qb, Hq * D)[b.valid]
    return out
