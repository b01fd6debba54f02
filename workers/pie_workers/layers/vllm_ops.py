"""vLLM's compiled ops, which the ``vllm`` backend runs in place of the torch code beside each use.

Measured on a 2-core CPU: RMSNorm on the tiny model's ``[32, 128]`` rows takes 3 µs against torch's 12.5 µs (50 µs
against 1.4 ms at ``[512, 1024]``), and can fuse the residual add before it; rotary embedding takes 5 µs against
20 µs; a matmul through oneDNN with the weight packed once takes 2-4x less than ``F.linear`` (which packs it again
on every call) at decode batch sizes on 1,024-wide layers. vLLM's CPU ``silu_and_mul`` is slower than torch's, so
it runs on GPUs only. The elementwise ops write their results in place, walk rows through a row stride but assume
each row contiguous, and give wrong results (no error) for other layouts: the wrappers pass them only 2-D
row-contiguous tensors."""

from __future__ import annotations

import torch


def _ops():
    import vllm._custom_ops as ops  # imported on first use: the torch backend never needs vLLM

    return ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension, into a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _ops().rms_norm(out.view(-1, x.shape[-1]), x.view(-1, x.shape[-1]), weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In place: ``residual += x``, then ``x = weight * residual / rms(residual)``; returns x. Both must be
    contiguous ``[T, hidden]`` (a layer's fresh outputs are)."""
    _ops().fused_add_rms_norm(x, residual, weight, eps)
    return x


def rotate(positions: torch.Tensor, x: torch.Tensor, head_dim: int, cos_sin: torch.Tensor) -> None:
    """Rotates every head of ``x`` (``[T, heads * head_dim]``, rows may be strided) in place, in the "rotate half"
    layout; ``cos_sin`` is ``[positions, head_dim]``, the cosines' half then the sines'."""
    _ops().rotary_embedding(positions, x, None, head_dim, cos_sin, True)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, one kernel (GPU)."""
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    torch.ops._C.silu_and_mul(out, gate_up.contiguous())
    return out


class PackedLinear:
    """``x @ weight.T + bias`` through vLLM's oneDNN matmul (CPU), with the weight packed into oneDNN's blocked
    layout once, here; the packed copy is all the layer keeps."""

    def __init__(self, weight: torch.Tensor):
        self.handle = _ops().create_onednn_mm(weight.t(), 32)  # 32: oneDNN primitives cached per input shape

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _ops().onednn_mm(self.handle, x.contiguous(), bias)


def onednn_available() -> bool:
    return bool(_ops()._supports_onednn)
