"""The KV pool of the ``vllm`` backend on CPU: vLLM's own cache layout, written and attended by its compiled ops.

Each layer's cache is one tensor ``[pages, kv_heads, 2 * page_size, head_dim]``, keys in the first half of a page's
rows and values in the second, as ``cpu_attn_reshape_and_cache`` and ``cpu_attention_with_kv_cache`` expect. Page
ids are the engine's own: a request's page list is its row of the kernel's block table. No page is gathered per
step, which is where the torch path spends its time at long contexts.

Inside a page, values are stored token-major (``[page_size, head_dim]``) but keys head-dim-major (``[head_dim,
page_size]``) for both ISA variants on this CPU (``vec16`` for pages of 16 tokens, ``vec`` for multiples of 32);
``torch_pages`` reads them back in the torch path's layout as views (its gather copies only the pages it needs).
Rows the kernel cannot express — a request with a custom attention mask, a head size or dtype the kernels were not
compiled for — take the torch path over those views in the same batch; rows of other requests keep the kernel's
result; sliding-window layers stay on the kernel, which takes the window. Whole-page operations (fork copies, host
offloads) move a page's bytes as they are, whatever their order inside it.
"""

from __future__ import annotations

import torch

from pie_workers.backends import kernel_variant
from pie_workers.batch_plan import BatchPlan, PagedRequests
from pie_workers.kv_pool import PoolShape
from pie_workers.layers.attention import overwrite_masked_rows, paged_attention
from pie_workers.layers.vllm_ops import kernels


class VllmCpuKVPool:
    needs_paged_requests = True  # plan_batch must describe each request (lengths, block table) for the kernel

    def __init__(self, shape: PoolShape):
        if shape.device.type != "cpu":
            raise ValueError(
                f"the vllm backend's CPU pool needs device cpu, not {shape.device} (see vllm_cuda_kv_pool)"
            )
        if shape.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the vllm backend's CPU kernels take float32 or bfloat16, not {shape.dtype}")
        self.isa = kernel_variant(shape.page_size)
        self.kv_layout = f"vllm-cpu-{self.isa}"  # keys' order inside a page differs by kernel variant
        self.num_pages, self.page_size, self.host_pages = shape.num_pages, shape.page_size, shape.host_pages
        per_page = (shape.local_kv_heads, 2 * shape.page_size, shape.cfg.head_dim)
        layers = shape.cfg.num_layers
        self.cache = torch.zeros((layers, shape.num_pages, *per_page), dtype=shape.dtype)
        self.host_cache = torch.zeros((layers, shape.host_pages, *per_page), dtype=shape.dtype)
        heads, head_dim = shape.local_kv_heads, shape.cfg.head_dim
        self.kernel_writes, self.kernel_attends = _kernel_supports(self.isa, heads, head_dim, shape.dtype)
        self.kernel_attends_all = self.kernel_attends  # (sliding windows included)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.kernel_writes:
            keys, values = self.cache[layer].chunk(2, dim=2)
            kernels().cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), keys, values, slots, self.isa)
            return
        keys, values = self.torch_pages(layer)  # the same layout, written through the views
        page, offset = slots // self.page_size, slots % self.page_size
        keys[page, offset], values[page, offset] = k, v

    def torch_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's pages in the torch path's layout ``[pages, page_size, kv_heads, head_dim]`` (views)."""
        keys, values = self.cache[layer].chunk(2, dim=2)
        pages, heads, size, dim = keys.shape
        return keys.view(pages, heads, dim, size).permute(0, 3, 1, 2), values.permute(0, 2, 1, 3)

    def attend(self, layer: int, q: torch.Tensor, plan: BatchPlan, window: int | None, scale: float) -> torch.Tensor:
        """``[T, Hq * D]``: the kernel for every request it can express, the torch path for the rest."""
        paged = plan.paged
        if not self.kernel_attends or paged is None or paged.has_empty_request:
            k_pages, v_pages = self.torch_pages(layer)
            return paged_attention(q, k_pages, v_pages, plan, window, scale)
        keys, values = self.cache[layer].chunk(2, dim=2)
        out = torch.empty_like(q)
        kernels().cpu_attention_with_kv_cache(
            q.contiguous(),
            keys,
            values,
            out,
            paged.query_start,
            paged.seq_lens,
            scale,
            True,
            None,
            -1 if window is None else window,
            paged.block_table,
            0.0,
            self._scheduler_metadata(paged, q, window),
            None,
            None,
        )
        out = out.view(q.shape[0], -1)
        if paged.masked_rows is not None:
            overwrite_masked_rows(out, q, *self.torch_pages(layer), plan, window, scale)
        return out

    def _scheduler_metadata(self, paged: PagedRequests, q: torch.Tensor, window: int | None) -> torch.Tensor:
        """How the kernel splits this batch over threads: computed on the first layer with this sliding window (or
        none), kept with the batch."""
        key = -1 if window is None else window
        if key not in paged.kernel_metadata:
            heads_q, heads_kv, dim = q.shape[1], self.cache.shape[2], q.shape[2]
            paged.kernel_metadata[key] = kernels().get_scheduler_metadata(
                paged.seq_lens.numel(), heads_q, heads_kv, dim, paged.seq_lens, q.dtype, paged.query_start, True,
                key, self.isa, False, None,
            )  # fmt: skip
        return paged.kernel_metadata[key]

    def move_to_host(self, pages: torch.Tensor, slots: torch.Tensor) -> None:  # whole pages, as their bytes lie
        if pages.numel():
            self.host_cache[:, slots] = self.cache[:, pages]

    def move_from_host(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        if pages.numel():
            self.cache[:, pages] = self.host_cache[:, slots]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (all layers): a fork's child gets its own copy of the parent's working pages."""
        if src.numel():
            self.cache[:, dst] = self.cache[:, src]

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """Whole pages as their bytes lie, ``[pages, layers, kv_heads, 2 * page_size, head_dim]`` (a copy)."""
        return self.cache[:, torch.tensor(pages, dtype=torch.long)].transpose(0, 1).contiguous()

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Install pages ``read_pages`` gave (of a pool of the same layout) into ``pages``."""
        self.cache[:, torch.tensor(pages, dtype=torch.long)] = data.to(self.cache.dtype).transpose(0, 1)


def _kernel_supports(isa: str, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether the kernels take this shape (they are compiled for some head sizes only): one write and one
    attention on a one-page cache. What they do not take runs the torch path over the same layout."""
    ops, size = kernels(), 16 if isa == "vec16" else 32
    cache = torch.zeros(1, kv_heads, 2 * size, head_dim, dtype=dtype)
    keys, values = cache.chunk(2, dim=2)
    token = torch.zeros(1, kv_heads, head_dim, dtype=dtype)
    try:
        ops.cpu_attn_reshape_and_cache(token, token, keys, values, torch.zeros(1, dtype=torch.long), isa)
    except RuntimeError:
        return False, False
    lengths, starts = torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    try:
        metadata = ops.get_scheduler_metadata(
            1, kv_heads, kv_heads, head_dim, lengths, dtype, starts, True, -1, isa, False, None
        )
        ops.cpu_attention_with_kv_cache(
            token, keys, values, torch.empty_like(token), starts, lengths, 1.0, True, None, -1,
            torch.zeros(1, 1, dtype=torch.int32), 0.0, metadata, None, None,
        )  # fmt: skip
    except RuntimeError:
        return True, False
    return True, True
