"""The ``torch`` backend's KV pool on a GPU: the torch pool's pages, written as on a CPU, attended by the Triton
kernel of ``layers.triton_attention`` over each request's block table instead of gathered into padded buckets.

The kernel expresses every request (sliding windows included) but those with a custom attention mask, so the plan
builds the torch path's buckets for those alone (``kernel_attends_all``) and their rows are recomputed over them
after the kernel, as the vllm backend's pools do. ``tests/model/test_triton_attention.py`` checks it under Triton's
interpreter on a CPU, and in bf16 wherever CUDA is.
"""

from __future__ import annotations

import dataclasses

import torch

from pie_workers.batch_plan import BatchPlan
from pie_workers.kv_pool import KVPool, PoolShape
from pie_workers.layers.attention import overwrite_masked_rows
from pie_workers.layers.triton_attention import triton_paged_attention


class TritonKVPool(KVPool):
    needs_paged_requests = True  # plan_batch must describe each request (lengths, block table) for the kernel
    kernel_attends_all = True

    def __init__(self, shape: PoolShape):
        """One page more than asked for, ``scratch_page``, given to no request: a CUDA graph's padded rows write
        their KV there (``cuda_graph_step``)."""
        super().__init__(dataclasses.replace(shape, num_pages=shape.num_pages + 1))
        self.num_pages = self.scratch_page = shape.num_pages

    def attend(self, layer: int, q: torch.Tensor, plan: BatchPlan, window: int | None, scale: float) -> torch.Tensor:
        """``[T, Hq * D]``: the kernel for every request, then the torch path for the custom-masked ones' rows."""
        k_pages, v_pages = self.k[layer], self.v[layer]
        out = triton_paged_attention(q, k_pages, v_pages, plan.paged, window, scale)
        if plan.paged.masked_rows is not None:
            overwrite_masked_rows(out, q, k_pages, v_pages, plan, window, scale)
        return out
