"""Rotary position embeddings (the HF "rotate half" layout), for free-form per-token positions."""

from __future__ import annotations

import math

import torch

from pie_workers.config import RopeConfig


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
    one gather instead of recomputing trigonometry."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)
        self.table: torch.Tensor | None = None  # [positions, 2, head_dim]: cos, sign-folded sin

    def cos_sin(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, head_dim]`` for the given positions (computed in fp32, as HF does).

        The sin table's first half is negated so that ``apply_rotary`` can swap halves without a negation.
        """
        if self.table is None or self.table.shape[0] <= max_position or self.table.dtype != dtype:
            size = max(1024, 1 << max_position.bit_length())
            freqs = torch.arange(size, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()
            self.table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1).to(dtype)
        rows = self.table.index_select(0, positions)
        return rows[:, :1], rows[:, 1:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, head_dim]``; HF's ``x * cos + rotate_half(x) * sin`` with the sign folded into the table."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin
