"""LoRA on the fused, tensor-parallel linears: one rank's share of an adapter, and its per-request application.

An adapter is kept per PEFT module (``q_proj`` ... ``down_proj``) as full matrices A ``[r, in]`` and B ``[out, r]``.
On one rank, a fused column-parallel linear (qkv, gate_up) gets one A stacking the targeted parts' A's (A is
replicated: each rank sees every input feature) and one block-diagonal B holding this rank's output rows of each
part, so the delta is two matmuls whatever the targets. A row-parallel linear (o, down) gets A's columns for its input
shard and the whole B; its delta is a partial sum added before the layer's all-reduce, so LoRA costs no extra
communication. The scaling (alpha / r) is folded into B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pie_workers.config import ModelConfig
from pie_workers.parallel import TensorParallel

# Our fused linears and the PEFT modules they hold, in output order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
PEFT_MODULES = tuple(m for parts in FUSED_PARTS.values() for m in parts)

# Full adapter matrices of one (layer, PEFT module): A [r, in], B [out, r].
ModuleWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every PEFT module name of a Llama-family layer."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True)
class LoraPair:
    """One adapter on one linear of this rank: ``delta = (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [R, in_local]
    b: torch.Tensor  # [out_local, R], scaled


def shard_for_rank(
    weights: ModuleWeights, scale: float, cfg: ModelConfig, tp: TensorParallel, device: torch.device, dtype: torch.dtype
) -> dict[tuple[int, str], LoraPair]:
    """This rank's pairs, keyed by (layer, our fused linear name), from full PEFT matrices."""
    shapes = module_shapes(cfg)
    pairs = {}
    for layer in sorted({layer for layer, _ in weights}):
        for linear, parts in FUSED_PARTS.items():
            targeted = [p for p in parts if (layer, p) in weights]
            if not targeted:
                continue
            if linear in ROW_PARALLEL:
                a, b = weights[layer, linear]
                start, end = tp.shard_range(a.shape[1])
                pairs[layer, linear] = _pair(a[:, start:end], b * scale, device, dtype)
                continue
            local_rows = [shapes[p][1] // tp.world_size for p in parts]
            a = torch.cat([weights[layer, p][0] for p in targeted])
            b = torch.zeros(sum(local_rows), a.shape[0])
            column = 0
            for p in targeted:
                i, r = parts.index(p), weights[layer, p][0].shape[0]
                first, n = sum(local_rows[:i]), local_rows[i]
                own = weights[layer, p][1][tp.rank * n : (tp.rank + 1) * n]
                b[first : first + n, column : column + r] = own * scale
                column += r
            pairs[layer, linear] = _pair(a, b, device, dtype)
    return pairs


def _pair(a: torch.Tensor, b: torch.Tensor, device: torch.device, dtype: torch.dtype) -> LoraPair:
    return LoraPair(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())


class LoraSite:
    """Every adapter present in a batch at one linear of one layer, with the rows it applies to."""

    def __init__(self, parts: list[tuple[torch.Tensor | None, LoraPair]]):
        self.parts = parts

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's delta to its own rows of ``y`` (rows None: every row); other rows are left untouched."""
        for rows, pair in self.parts:
            if rows is None:
                y.addmm_(x @ pair.a.T, pair.b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ pair.a.T) @ pair.b.T)


class BatchLora:
    """The LoRA work of one batch: each (adapter, zo seed) group's token rows and its pairs on this rank."""

    def __init__(self, groups: list[tuple[torch.Tensor | None, dict[tuple[int, str], LoraPair]]]):
        self.groups = groups

    def at(self, layer: int, linear: str) -> LoraSite | None:
        parts = [(rows, pairs[layer, linear]) for rows, pairs in self.groups if (layer, linear) in pairs]
        return LoraSite(parts) if parts else None
