"""The KV pool of the ``vllm`` backend on a GPU: the torch pool's layout, which is FlashAttention's own
(``[pages, page_size, kv_heads, head_dim]`` per layer), written by vLLM's ``reshape_and_cache_flash`` and attended
by its ``flash_attn_varlen_func`` over a block table of the engine's page ids.

FlashAttention aligns each request's causal mask to the end of its keys, which is what decode, chunked prefill and
a pass on top of a cached prefix need. What it cannot express runs the torch path over the same tensors in the
same batch, as on the CPU: requests with a custom attention mask (their buckets only) and sliding-window layers.
No GPU is available where this repository's CI runs: ``tests/model/test_gpu.py`` checks this pool wherever CUDA is.
"""

from __future__ import annotations

import torch

from pie_workers.batch_plan import BatchPlan
from pie_workers.kv_pool import KVPool, PoolShape
from pie_workers.layers.attention import overwrite_masked_rows


class VllmCudaKVPool(KVPool):
    needs_paged_requests = True  # plan_batch must describe each request (lengths, block table) for the kernel

    def __init__(self, shape: PoolShape):
        if shape.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the vllm backend's GPU kernels take bfloat16 or float16, not {shape.dtype}")
        if shape.page_size % 16:
            raise ValueError(f"the vllm backend's GPU kernels need a page_size multiple of 16, got {shape.page_size}")
        _check_cuda_build()
        super().__init__(shape)
        self._unit_scale = torch.ones((), dtype=torch.float32, device=shape.device)  # no KV quantisation

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        import vllm._custom_ops as ops

        scale = self._unit_scale
        ops.reshape_and_cache_flash(k, v, self.k[layer], self.v[layer], slots, "auto", scale, scale)

    def attend(self, layer: int, q: torch.Tensor, plan: BatchPlan, window: int | None, scale: float) -> torch.Tensor:
        """``[T, Hq * D]``: FlashAttention for every request it can express, the torch path for the rest."""
        paged = plan.paged
        if window is not None or paged is None or paged.has_empty_request:
            return super().attend(layer, q, plan, window, scale)
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        out = torch.empty_like(q)
        flash_attn_varlen_func(
            q,
            self.k[layer],
            self.v[layer],
            max_seqlen_q=paged.max_query_len,
            cu_seqlens_q=paged.query_start,
            max_seqlen_k=paged.max_seq_len,
            seqused_k=paged.seq_lens,
            softmax_scale=scale,
            causal=True,
            block_table=paged.block_table,
            out=out,
        )
        out = out.view(q.shape[0], -1)
        if paged.masked_rows is not None:
            overwrite_masked_rows(out, q, self.k[layer], self.v[layer], plan, window, scale)
        return out


def _check_cuda_build() -> None:
    """vLLM's CPU build (what ``make test`` installs) has neither op, and a GPU host may have no vLLM at all: say
    so before the first batch fails."""
    try:
        import vllm._custom_ops  # noqa: F401  (registers the compiled ops)
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401

        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        raise ValueError(
            "the vllm backend on a GPU needs vLLM's CUDA build (pip install --no-deps vllm==0.32.0, which make "
            f"gpu-check does where pip can reach its index): {e}"
        ) from e
