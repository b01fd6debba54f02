"""Tensor-parallel linear layers and embeddings (Megatron style).

Column-parallel layers split the output features across ranks and need no communication; row-parallel layers split
the input features and all-reduce their partial sums. Weights are loaded shard by shard: each rank reads only its
rows/columns from the checkpoint (see ``pie_workers.loader``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pie_workers.layers.lora import LoraSite
from pie_workers.parallel import TensorParallel


class TorchPackedLinear:
    """torch's own oneDNN matmul — the one its compiler uses once weights are frozen — over a weight reordered into
    oneDNN's blocked layout once, here. ``F.linear`` repacks the weight on every call, which at decode batch sizes
    costs more than the product (measured: 2-4x slower on 1,024-wide layers, 1.5x on a 128 x 4,096 LM head)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor lowers this op only over weights it froze itself
            return torch.ops.pie.packed_linear(x, self.weight, bias)  # (layers.graph_ops)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


class PackableLinear(torch.nn.Module):
    """``x W^T (+ b)`` by ``F.linear``, or — after ``pack``, on a CPU — by a matmul over a copy of W packed once for
    oneDNN (torch's, or vLLM's for the ``vllm`` backend), which then replaces W."""

    weight: torch.nn.Parameter
    packed: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def pack(self, packer: Callable[[torch.Tensor], Callable]) -> None:
        self.packed = packer(self.weight)
        self.weight = torch.nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias) if self.packed is None else self.packed(x, bias)


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T`` with W's output rows split across ranks; several checkpoint matrices may be fused.

    ``out_features`` lists the full output size of each fused part (e.g. q, k, v); each part is split evenly, so a
    rank's local weight is ``[sum(part // world), in]`` and its output is its slice of every part, in order.
    """

    def __init__(self, in_features: int, out_features: list[int], bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.parts = [n // tp.world_size for n in out_features]
        for n in out_features:
            tp.shard_range(n)  # validates divisibility with a clear message
        self.weight = torch.nn.Parameter(torch.empty(sum(self.parts), in_features), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(sum(self.parts)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, lora: LoraSite | None = None) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if lora is not None:
            lora.add_(x, y)
        return y


class RowParallelLinear(PackableLinear):
    """``y = x W^T`` with W's input columns split; partial products are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        start, end = tp.shard_range(in_features)
        self.weight = torch.nn.Parameter(torch.empty(out_features, end - start), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, lora: LoraSite | None = None) -> torch.Tensor:
        """A LoRA delta on this rank's input shard is a partial sum too: it joins the same all-reduce."""
        y = self.matmul(x)
        if lora is not None:
            lora.add_(x, y)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def padded_vocab(vocab_size: int, tp: TensorParallel) -> int:
    return -(-vocab_size // tp.world_size) * tp.world_size


class VocabParallelEmbedding(torch.nn.Module):
    """Each rank holds a contiguous slice of the (padded) vocabulary; lookups outside it contribute zeros."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.shard_range(padded_vocab(vocab_size, tp))
        self.weight = torch.nn.Parameter(torch.zeros(self.end - self.start, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackableLinear):
    """Vocab-parallel output projection; the leader gathers full logits, trimmed to the real vocabulary."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.end = tp.shard_range(padded_vocab(vocab_size, tp))
        self.weight = torch.nn.Parameter(torch.zeros(self.end - self.start, dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_last_dim(self.matmul(x))
        return None if logits is None else logits[..., : self.vocab_size]
