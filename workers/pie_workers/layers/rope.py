"""Rotary position embeddings (the HF "rotate half" layout), for free-form per-token positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pie_workers.config import RopeConfig
from pie_workers.layers import vllm_ops


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # fp32 throughout, as transformers computes it, so positions in the thousands agree to the last bit
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by ``factor``, short ones kept."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Looks cos/sin up in a table that grows (doubling) to the largest position seen, so a decode step costs
    one gather instead of recomputing trigonometry; ``use_vllm_ops`` rotates with vLLM's compiled kernel."""

    def __init__(self, rope: RopeConfig, head_dim: int, use_vllm_ops: bool = False):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)
        self.head_dim, self.use_vllm_ops = head_dim, use_vllm_ops
        # torch: [positions, 2, head_dim], cos and sign-folded sin; vLLM's kernel: [positions, head_dim], the cos
        # then the sin of each frequency
        self.table: torch.Tensor | None = None

    def for_batch(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> Rotation:
        """The rotation of a batch's tokens at ``positions`` (computed in fp32, as HF does, then cast)."""
        self.reserve(max_position, dtype)
        if self.use_vllm_ops:
            return Rotation(positions, self.head_dim, cos_sin=self.table)
        rows = self.table.index_select(0, positions)
        return Rotation(positions, self.head_dim, cos=rows[:, :1], signed_sin=rows[:, 1:])

    def reserve(self, max_position: int, dtype: torch.dtype) -> None:
        """Grow the table to hold ``max_position`` (a compiled step reserves it outside its graph)."""
        if self.table is None or self.table.shape[0] <= max_position or self.table.dtype != dtype:
            size = max(1024, 1 << max_position.bit_length())
            freqs = torch.arange(size, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()
            if self.use_vllm_ops:
                self.table = torch.cat((cos, sin), -1).to(dtype)
            else:  # the sin's first half negated, so that apply_rotary can swap halves without a negation
                self.table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1).to(dtype)


@dataclass
class Rotation:
    """One batch's rotary embedding: the torch path's per-token cos/sin rows, or the table vLLM's kernel reads."""

    positions: torch.Tensor  # [T]
    head_dim: int
    cos: torch.Tensor | None = None  # [T, 1, head_dim]
    signed_sin: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None  # [positions, head_dim]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, heads * head_dim]`` (rows may be strided, e.g. a slice of the fused q/k/v projection);
        returns it rotated as ``[T, heads, head_dim]`` (vLLM's kernel rotates it in place)."""
        heads = x.view(x.shape[0], -1, self.head_dim)
        if self.cos_sin is None:
            return apply_rotary(heads, self.cos, self.signed_sin)
        vllm_ops.rotate(self.positions, x, self.head_dim, self.cos_sin)
        return heads


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, head_dim]``; HF's ``x * cos + rotate_half(x) * sin`` with the sign folded into the table."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin
