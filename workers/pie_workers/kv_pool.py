"""The paged KV pool of one rank: fixed-size pages of K and V for every layer.

Pages are gathered whole for attention; single tokens are written by flat slot ``page * page_size + offset``.
The pool knows nothing about requests; the replica hands each batch its page lists. Sized by an explicit page
count or by a fraction of free memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pie_workers.batch_plan import BatchPlan
from pie_workers.config import ModelConfig
from pie_workers.layers.attention import paged_attention


def page_bytes(cfg: ModelConfig, page_size: int, local_kv_heads: int, dtype: torch.dtype) -> int:
    """Bytes one page takes on one rank: K and V, every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * local_kv_heads * cfg.head_dim * elem


def pages_for_memory_fraction(fraction: float, bytes_per_page: int, device: torch.device) -> int:
    """How many pages fit in ``fraction`` of the device's currently free memory."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory fraction {fraction} must be in (0, 1]")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, int(free * fraction) // bytes_per_page)


@dataclass(frozen=True)
class PoolShape:
    """What any backend's pool is built from: the model, how many pages of how many tokens, this rank's KV heads,
    and ``host_pages``, a buffer in host memory (pinned when the pool is on a GPU) where suspended contexts' pages
    wait instead of being recomputed."""

    cfg: ModelConfig
    num_pages: int
    page_size: int
    local_kv_heads: int
    dtype: torch.dtype
    device: torch.device
    host_pages: int = 0


class KVPool:
    """The ``torch`` backend's pool: ``[layers, pages, page_size, kv_heads, head_dim]`` for K and for V, attended
    by gathering whole pages (``layers.attention``). Any backend's pool has these methods; the model calls only
    ``write`` and ``attend``, the runner the page moves."""

    needs_paged_requests = False
    kernel_attends_all = False  # every layer of every request a paged kernel can express (see ``plan_batch``)
    kv_layout = "nhd"  # how a page's bytes lie (``read_pages``): another replica installs them only in the same

    def __init__(self, shape: PoolShape):
        if shape.num_pages < 1 or shape.page_size < 1:
            raise ValueError(f"KV pool needs >= 1 page of >= 1 token (got {shape.num_pages} x {shape.page_size})")
        self.num_pages, self.page_size, self.host_pages = shape.num_pages, shape.page_size, shape.host_pages
        per_page = (shape.page_size, shape.local_kv_heads, shape.cfg.head_dim)
        layers, dtype, device = shape.cfg.num_layers, shape.dtype, shape.device
        # zero-filled: padded attention reads stale slots under a mask, and 0 * -inf must never meet a NaN
        self.k = torch.zeros((layers, shape.num_pages, *per_page), dtype=dtype, device=device)
        self.v = torch.zeros((layers, shape.num_pages, *per_page), dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.host_k = torch.zeros((layers, shape.host_pages, *per_page), dtype=dtype, pin_memory=pin)
        self.host_v = torch.zeros((layers, shape.host_pages, *per_page), dtype=dtype, pin_memory=pin)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].flatten(0, 1).index_copy_(0, slots, k)
        self.v[layer].flatten(0, 1).index_copy_(0, slots, v)

    def attend(self, layer: int, q: torch.Tensor, plan: BatchPlan, window: int | None, scale: float) -> torch.Tensor:
        return paged_attention(q, self.k[layer], self.v[layer], plan, window, scale)

    def move_to_host(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        if pages.numel():
            device_pages = pages.to(self.k.device)
            self.host_k[:, slots] = self.k[:, device_pages].cpu()
            self.host_v[:, slots] = self.v[:, device_pages].cpu()

    def move_from_host(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        if pages.numel():
            device_pages = pages.to(self.k.device)
            self.k[:, device_pages] = self.host_k[:, slots].to(self.k.device, non_blocking=True)
            self.v[:, device_pages] = self.host_v[:, slots].to(self.k.device, non_blocking=True)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (all layers) — forks give a child its own copy of the parent's working pages."""
        if src.numel():
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """Whole pages as they lie, ``[pages, 2 (K, V), layers, page_size, kv_heads, head_dim]`` in host memory:
        what a replica that leaves hands another (``engine/transfer.py``)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        return torch.stack((self.k[:, index], self.v[:, index]), dim=1).transpose(0, 2).contiguous().cpu()

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Install pages ``read_pages`` gave (of a pool of the same layout) into ``pages``."""
        index = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        data = data.to(self.k.device, self.k.dtype)
        self.k[:, index] = data[:, 0].transpose(0, 1)
        self.v[:, index] = data[:, 1].transpose(0, 1)
