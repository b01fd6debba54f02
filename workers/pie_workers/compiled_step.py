"""The common decode step — one query row per request, no custom mask, no adapter, no page moves — run as a graph
compiled by ``torch.compile`` on a CPU (``decode_graphs`` picks it, or CUDA graphs on a GPU: ``cuda_graph_step``);
every other pass stays eager in the same runner.

Batches are padded to a few sizes, each one static-shape graph compiled at start-up; padded rows write no KV and
attend one slot of page 0, and their outputs are dropped. The block table's width (pages of the longest request) is
the graphs' one dynamic dimension: only the attention op reads it. The KV write and paged attention are custom ops
(``layers.graph_ops``) over the pool's cache, so the graph holds around them instead of breaking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pie_workers.batch_plan import BatchPlan
from pie_workers.kv_pool import KVPool
from pie_workers.layers import graph_ops  # noqa: F401  (registers the torch.ops.pie ops)
from pie_workers.layers.vllm_ops import kernels
from pie_workers.models.llama import LlamaModel
from pie_workers.vllm_kv_pool import VllmCpuKVPool
from pie_workers.wire.batch import ForwardBatch

# the graphs' shapes are checked where they are made: a step's ~40 size asserts cost ~30 µs on the tiny model
OPTIONS = {"size_asserts": False}


@dataclass
class _TorchDecodeKV:
    """The torch pool as the model sees it inside the graph: ``write`` and ``attend`` through the custom ops."""

    pool: KVPool
    block_table: torch.Tensor
    masks: dict[int, torch.Tensor]  # additive [B, 1, 1, P * page_size], by window (-1: none)
    rows: torch.Tensor

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        torch.ops.pie.torch_kv_write(self.pool.k, self.pool.v, layer, slots, k, v, self.rows)

    def attend(self, layer: int, q: torch.Tensor, plan: BatchPlan, window: int | None, scale: float) -> torch.Tensor:
        mask = self.masks[-1 if window is None else window]
        return torch.ops.pie.torch_paged_decode(q, self.pool.k, self.pool.v, layer, self.block_table, mask, scale)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Steps with page copies run eager."""


def _decode_masks(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, windows: list[int], dtype):
    """Each request's query (its last slot) sees its slots up to it, within the window: 0 / -inf, by window."""
    slot = torch.arange(block_table.shape[1] * page_size)
    last = seq_lens[:, None] - 1
    masks = {}
    for window in windows:
        allowed = (slot <= last) if window == -1 else (slot <= last) & (last - slot < window)
        masks[window] = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))[:, None, None]
    return masks


@dataclass
class _VllmDecodeKV:
    """The vllm backend's CPU pool inside the graph: its kernels through the custom ops."""

    pool: VllmCpuKVPool
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    metadata: dict[int, torch.Tensor]  # the kernel's work split, by window (-1: none)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        torch.ops.pie.vllm_kv_write(self.pool.cache, layer, slots, k, v, self.pool.isa)

    def attend(self, layer: int, q: torch.Tensor, plan: BatchPlan, window: int | None, scale: float) -> torch.Tensor:
        key = -1 if window is None else window
        return torch.ops.pie.vllm_paged_decode(
            q, self.pool.cache, layer, self.query_start, self.seq_lens, self.block_table, self.metadata[key], scale, key
        )

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Steps with page copies run eager."""


class CompiledDecode:
    """Decode steps of ``model`` over ``kv`` through one compiled graph per batch size of ``sizes``."""

    kind = "torch.compile"

    def __init__(self, model: LlamaModel, kv: KVPool | VllmCpuKVPool, sizes: tuple[int, ...]):
        self.model, self.kv, self.sizes = model, kv, tuple(sorted(sizes))
        self.windows = sorted({-1 if w is None else w for w in model.cfg.layer_windows})
        self.dtype = model.embed_tokens.weight.dtype
        # every size of every runner in the process is a recompile of the same code: make room for this one's
        torch._dynamo.config.recompile_limit += 2 * len(self.sizes)
        self._graph = torch.compile(self._forward, dynamic=False, fullgraph=True, options=OPTIONS)

    def accepts(self, batch: ForwardBatch) -> bool:
        return plain_decode(batch, self.sizes[-1])

    @torch.inference_mode()  # as ``ModelRunner.execute`` runs: grad mode is part of what a graph is compiled for
    def warm_up(self) -> None:
        """Compile every size now (all rows padding) rather than on the first step of each."""
        self.model.rotary.reserve(self.model.cfg.max_position_embeddings, self.dtype)
        none = torch.zeros(0, dtype=torch.long)
        for size in self.sizes:
            self._run(*self._padded(none, none, none, torch.zeros(0, 2, dtype=torch.int32), none.int(), size))

    def __call__(self, plan: BatchPlan) -> torch.Tensor:
        """Logits of ``plan.logit_rows``, for a plan of an accepted batch (made with ``paged_requests``)."""
        n, paged = plan.num_tokens, plan.paged
        size = next(s for s in self.sizes if s >= n)
        self.model.rotary.reserve(plan.max_position, self.dtype)
        inputs = self._padded(plan.token_ids, plan.positions, plan.write_slots, paged.block_table, paged.seq_lens, size)
        logits = self._run(*inputs)[:n]
        return logits if plan.every_row_has_logits else logits[plan.logit_rows]

    @staticmethod
    def _padded(token_ids, positions, slots, block_table, seq_lens, size: int) -> tuple:
        """The batch padded to ``size`` rows (padding: no KV write, one slot attended) and to at least two pages
        (a width of one would be specialised apart from the others)."""
        pad = size - token_ids.shape[0]
        width_pad = max(0, 2 - block_table.shape[1])
        return (
            F.pad(token_ids, (0, pad)),
            F.pad(positions, (0, pad)),
            F.pad(slots, (0, pad), value=-1),
            F.pad(block_table, (0, width_pad, 0, pad)),
            F.pad(seq_lens, (0, pad), value=1),
            torch.tensor(token_ids.shape[0]),
        )

    def _run(self, token_ids, positions, slots, block_table, seq_lens, rows) -> torch.Tensor:
        torch._dynamo.mark_dynamic(block_table, 1)
        if isinstance(self.kv, VllmCpuKVPool):
            query_start = torch.arange(token_ids.shape[0] + 1, dtype=torch.int32)
            metadata = {w: self._kernel_metadata(seq_lens, query_start, w) for w in self.windows}
            kv = (block_table, seq_lens, query_start, metadata)
        else:
            kv = (block_table, seq_lens, rows)
        return self._graph(token_ids, positions, slots, kv)

    def _kernel_metadata(self, seq_lens: torch.Tensor, query_start: torch.Tensor, window: int) -> torch.Tensor:
        cfg = self.model.cfg
        heads, kv_heads = cfg.num_heads, self.kv.cache.shape[2]
        return kernels().get_scheduler_metadata(
            seq_lens.numel(), heads, kv_heads, cfg.head_dim, seq_lens, self.dtype, query_start, True, window,
            self.kv.isa, False, None,
        )  # fmt: skip

    def _forward(self, token_ids, positions, slots, kv_inputs) -> torch.Tensor:
        """The graph: the model's own forward over a plan of the padded batch and the pool seen through the ops."""
        empty = token_ids[:0]
        plan = BatchPlan(token_ids, positions, slots, [], empty, empty, empty, every_row_has_logits=True)
        if isinstance(self.kv, VllmCpuKVPool):
            return self.model(plan, _VllmDecodeKV(self.kv, *kv_inputs), None)
        block_table, seq_lens, rows = kv_inputs
        masks = _decode_masks(block_table, seq_lens, self.kv.page_size, self.windows, self.dtype)
        return self.model(plan, _TorchDecodeKV(self.kv, block_table, masks, rows), None)


def plain_decode(batch: ForwardBatch, largest: int) -> bool:
    """Whether a step is a plain decode step of at most ``largest`` requests: one new row each, no custom mask,
    adapter, draft or zo seed, no page moves (checked before planning)."""
    return (
        0 < len(batch.requests) <= largest
        and not (batch.page_copies or batch.offloads or batch.restores)
        and all(
            len(r.token_ids) == 1
            and r.attention_masks is None
            and not r.draft_tokens
            and r.adapter is None
            and r.zo_seed is None
            for r in batch.requests
        )
    )
