"""Decode steps on a GPU replayed from CUDA graphs: one graph per padded batch size, captured when the runner starts,
over static input buffers that each step refills. A batch-1 decode step of eager PyTorch is ~15 kernel launches a
layer, each a few microseconds of Python and driver work, against a few microseconds of GPU time; a replay launches
them all at once.

What a graph holds is fixed at capture: the buffers' addresses, every tensor's shape, every Python value. So the
inputs live in buffers sized for the largest batch and the longest context the rotary table holds; a step of ``n``
requests is padded to the next captured size, its padded rows reading and writing only the pool's scratch page
(``TritonKVPool.scratch_page``); the attention kernel reads each request's length and pages from the buffers on the
device, so one graph serves every context length. Steps a graph cannot hold (``plain_decode``) and steps past the
buffers' bounds run eager in the same runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pie_workers.batch_plan import BatchPlan, PagedRequests
from pie_workers.compiled_step import plain_decode
from pie_workers.models.llama import LlamaModel
from pie_workers.triton_kv_pool import TritonKVPool
from pie_workers.wire.batch import ForwardBatch
from pie_workers.wire.pages import pages_for


@dataclass
class _Inputs:
    """The buffers every graph reads, sized for the largest batch; a graph of ``size`` rows reads their first rows."""

    token_ids: torch.Tensor  # [largest] int64
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor  # [largest] int32
    block_table: torch.Tensor  # [largest, pages the rotary table spans] int32
    query_start: torch.Tensor  # [largest + 1] int32: one row per request, always

    def plan(self, size: int, max_position: int) -> BatchPlan:
        """The plan a graph of ``size`` rows is captured with: views of the buffers, every row with logits."""
        empty = self.token_ids[:0]
        paged = PagedRequests(
            query_start=self.query_start[: size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], masked_rows=None, masked_buckets=[], has_empty_request=False,
            max_query_len=1, max_seq_len=max_position + 1,
        )  # fmt: skip
        return BatchPlan(
            self.token_ids[:size], self.positions[:size], self.slots[:size], [], empty, empty, empty,
            every_row_has_logits=True, max_position=max_position, paged=paged,
        )  # fmt: skip


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab]: where each replay leaves its output


class CudaGraphDecode:
    """Plain decode steps of ``model`` over ``kv`` (one GPU rank) through one CUDA graph per batch size of ``sizes``."""

    kind = "CUDA graphs"

    def __init__(self, model: LlamaModel, kv: TritonKVPool, sizes: tuple[int, ...]):
        self.model, self.kv, self.sizes = model, kv, tuple(sorted(sizes))
        dtype, device = model.embed_tokens.weight.dtype, kv.k.device
        model.rotary.reserve(model.cfg.max_position_embeddings, dtype)  # the table a graph reads must never move
        self.positions_held = model.rotary.table.shape[0]
        largest, width = self.sizes[-1], pages_for(self.positions_held, kv.page_size)
        self.scratch_slot = kv.scratch_page * kv.page_size
        # every row starts as padding: token 0 at position 0, writing the scratch slot, attending one slot of it
        self.inputs = _Inputs(
            token_ids=torch.zeros(largest, dtype=torch.long, device=device),
            positions=torch.zeros(largest, dtype=torch.long, device=device),
            slots=torch.full((largest,), self.scratch_slot, dtype=torch.long, device=device),
            seq_lens=torch.ones(largest, dtype=torch.int32, device=device),
            block_table=torch.full((largest, width), kv.scratch_page, dtype=torch.int32, device=device),
            query_start=torch.arange(largest + 1, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, _Graph] = {}

    def accepts(self, batch: ForwardBatch) -> bool:
        return plain_decode(batch, self.sizes[-1])

    @torch.inference_mode()  # as ``ModelRunner.execute`` runs
    def capture(self) -> None:
        """Every size's graph, largest first so that the smaller ones reuse its memory pool. Each is run once
        uncaptured first, on a side stream as CUDA graphs ask: Triton compiles its kernel, cuBLAS picks its own."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):
            plan = self.inputs.plan(size, self.positions_held - 1)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.model(plan, self.kv, None)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(plan, self.kv, None)
            self.graphs[size] = _Graph(graph, logits)
        torch.cuda.synchronize()

    def __call__(self, plan: BatchPlan) -> torch.Tensor:
        """Logits of ``plan.logit_rows`` for an accepted batch's plan, still on the host (made with
        ``paged_requests``); a step past the buffers' bounds runs eager."""
        n, paged = plan.num_tokens, plan.paged
        if plan.max_position >= self.positions_held or paged.block_table.shape[1] > self.inputs.block_table.shape[1]:
            return self.model(plan.to(self.kv.k.device), self.kv, None)
        size = next(s for s in self.sizes if s >= n)
        self._load(plan, size)
        graph = self.graphs[size]
        graph.graph.replay()
        logits = graph.logits[:n]
        return logits if plan.every_row_has_logits else logits[plan.logit_rows.to(logits.device)]

    def _load(self, plan: BatchPlan, size: int) -> None:
        """The step's rows into the buffers, padded to ``size``: every row of the graph is rewritten, since a
        padded row left from a larger step would write its old request's KV slot."""
        pad, inputs = size - plan.num_tokens, self.inputs
        inputs.token_ids[:size].copy_(F.pad(plan.token_ids, (0, pad)), non_blocking=True)
        inputs.positions[:size].copy_(F.pad(plan.positions, (0, pad)), non_blocking=True)
        inputs.slots[:size].copy_(F.pad(plan.write_slots, (0, pad), value=self.scratch_slot), non_blocking=True)
        inputs.seq_lens[:size].copy_(F.pad(plan.paged.seq_lens, (0, pad), value=1), non_blocking=True)
        table = F.pad(plan.paged.block_table, (0, 0, 0, pad), value=self.kv.scratch_page)
        inputs.block_table[:size, : table.shape[1]].copy_(table, non_blocking=True)
