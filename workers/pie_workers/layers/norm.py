"""RMSNorm as Llama/Qwen define it (normalise in fp32, scale in the weight's dtype), with the pre-norm block's
residual add optionally fused in; ``use_vllm_ops`` runs vLLM's compiled kernel instead of torch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pie_workers.layers import vllm_ops


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, use_vllm_ops: bool = False):
        super().__init__()
        self.eps, self.use_vllm_ops = eps, use_vllm_ops
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_vllm_ops:
            return vllm_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual stream after a sublayer, and its normalised input
        to the next one. With vLLM's ops both are written in place over ``x`` and ``residual``."""
        if self.use_vllm_ops:
            return vllm_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self(residual), residual
