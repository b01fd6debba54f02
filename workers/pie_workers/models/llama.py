"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV pool, tensor-parallel aware.

Attention heads and MLP columns are split across ranks; q/k/v and gate/up are fused into single matmuls. Weight
names follow the Hugging Face checkpoints, so ``load`` reads them directly (each rank only its shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pie_workers.batch_plan import BatchPlan
from pie_workers.config import ModelConfig
from pie_workers.kv_pool import KVPool
from pie_workers.layers import vllm_ops
from pie_workers.layers.linear import (
    ColumnParallelLinear,
    PackableLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pie_workers.layers.lora import BatchLora, LoraSite
from pie_workers.layers.norm import RMSNorm
from pie_workers.layers.rope import RotaryEmbedding, Rotation
from pie_workers.loader import CheckpointReader
from pie_workers.parallel import TensorParallel


@dataclass(frozen=True)
class LayerBias:
    """Which projections carry a bias in the checkpoint (Qwen2: q/k/v)."""

    qkv: bool
    o: bool


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, index: int, bias: LayerBias, use_vllm_ops: bool):
        super().__init__()
        self.index, self.use_vllm_ops = index, use_vllm_ops
        self.window = cfg.layer_windows[index]
        d = cfg.head_dim
        self.local_heads = cfg.num_heads // tp.world_size
        self.local_kv_heads = cfg.num_kv_heads // tp.world_size
        self.head_dim = d
        self.scale = d**-0.5
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, use_vllm_ops)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], bias.qkv, tp
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias.o, tp)
        self.q_norm = RMSNorm(d, eps, use_vllm_ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, eps, use_vllm_ops) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, use_vllm_ops)
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, tp
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotation: Rotation, plan: BatchPlan, kv: KVPool,
        lora: BatchLora | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``x``: the previous layer's MLP output (layer 0: the embeddings, with no residual yet). Returns this
        layer's MLP output and the residual stream it is added to — the add happens in the next norm, where vLLM's
        kernel fuses it."""
        T, d = x.shape[0], self.head_dim

        def site(linear: str) -> LoraSite | None:
            return lora.at(self.index, linear) if lora is not None else None

        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        qkv = self.qkv_proj(h, site("qkv_proj"))
        n_q, n_kv = self.local_heads, self.local_kv_heads
        if self.q_norm is None:  # rotate q and k together: they are adjacent in the fused projection
            qk = rotation(qkv[:, : (n_q + n_kv) * d])
            q, k = qk[:, :n_q], qk[:, n_q:]
        else:
            q = rotation(self.q_norm(qkv[:, : n_q * d].view(T, n_q, d)).view(T, -1))
            k = rotation(self.k_norm(qkv[:, n_q * d : (n_q + n_kv) * d].view(T, n_kv, d)).view(T, -1))
        v = qkv[:, (n_q + n_kv) * d :].view(T, n_kv, d)
        kv.write(self.index, plan.write_slots, k, v)
        attn = kv.attend(self.index, q, plan, self.window, self.scale)
        h, residual = self.post_attention_layernorm.add_forward(self.o_proj(attn, site("o_proj")), residual)
        gate_up = self.gate_up_proj(h, site("gate_up_proj"))
        return self.down_proj(self._silu_and_mul(gate_up), site("down_proj")), residual

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.use_vllm_ops and gate_up.is_cuda:  # vLLM's CPU kernel is slower than torch's two ops
            return vllm_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, reader: CheckpointReader, use_vllm_ops: bool = False):
        """``use_vllm_ops``: RMSNorm, rotary embedding (and on GPUs SiLU-and-multiply) by vLLM's compiled kernels
        (the ``vllm`` backend), else by torch."""
        super().__init__()
        if cfg.num_heads % tp.world_size or cfg.num_kv_heads % tp.world_size:
            raise ValueError(
                f"{cfg.num_heads} attention heads / {cfg.num_kv_heads} KV heads cannot be split over "
                f"tensor-parallel size {tp.world_size}"
            )
        self.cfg, self.tp = cfg, tp
        attn = "model.layers.0.self_attn"
        bias = LayerBias(qkv=reader.has(f"{attn}.q_proj.bias"), o=reader.has(f"{attn}.o_proj.bias"))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, tp, i, bias, use_vllm_ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, use_vllm_ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, use_vllm_ops)

    def forward(self, plan: BatchPlan, kv: KVPool, lora: BatchLora | None = None) -> torch.Tensor | None:
        """Runs every token of the plan; returns logits ``[N, vocab]`` of ``plan.logit_rows`` on the leader.

        ``lora``: the adapters of the batch's requests, each on its own token rows."""
        kv.copy_pages(plan.copy_src, plan.copy_dst)
        x, residual = self.embed_tokens(plan.token_ids), None
        rotation = self.rotary.for_batch(plan.positions, plan.max_position, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rotation, plan, kv, lora)
        h = x + residual
        h = self.norm(h if plan.every_row_has_logits else h[plan.logit_rows])
        logits = self.lm_head(h)
        return None if logits is None else logits.float()

    def pack_linear_weights(self, packer: Callable[[torch.Tensor], Callable], min_elements: int = 0) -> None:
        """On a CPU: the projection weights of at least ``min_elements`` packed once for a oneDNN matmul."""
        for module in self.modules():
            if isinstance(module, PackableLinear) and module.weight.numel() >= min_elements:
                module.pack(packer)

    def load(self, reader: CheckpointReader, show_progress: bool) -> None:
        """Fill every parameter from the checkpoint (this rank's shards only), one layer at a time."""
        cfg, tp = self.cfg, self.tp
        hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d

        def put(param: torch.nn.Parameter, value: torch.Tensor) -> None:
            param.data = value.to(dtype=param.dtype, device=param.device).contiguous()

        def columns(name: str, rows: int) -> torch.Tensor:  # this rank's output rows of a column-parallel weight
            return reader.read(name, (rows, hidden), shard_dim=0, tp=tp)

        def vector(name: str, size: int, sharded: bool = False) -> torch.Tensor:
            return reader.read(name, (size,), shard_dim=0 if sharded else None, tp=tp)

        emb = self.embed_tokens
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        put(emb.weight, reader.read_rows("model.embed_tokens.weight", (cfg.vocab_size, hidden), emb.start, emb.end))
        put(self.lm_head.weight, reader.read_rows(head, (cfg.vocab_size, hidden), emb.start, emb.end))
        put(self.norm.weight, vector("model.norm.weight", hidden))
        for i, layer in enumerate(tqdm(self.layers, desc="loading weights", unit="layer", disable=not show_progress)):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            put(layer.input_layernorm.weight, vector(f"{p}.input_layernorm.weight", hidden))
            put(layer.post_attention_layernorm.weight, vector(f"{p}.post_attention_layernorm.weight", hidden))
            qkv = [(f"{a}.q_proj", q_out), (f"{a}.k_proj", kv_out), (f"{a}.v_proj", kv_out)]
            put(layer.qkv_proj.weight, torch.cat([columns(f"{n}.weight", rows) for n, rows in qkv]))
            if layer.qkv_proj.bias is not None:
                put(layer.qkv_proj.bias, torch.cat([vector(f"{n}.bias", rows, sharded=True) for n, rows in qkv]))
            put(layer.o_proj.weight, reader.read(f"{a}.o_proj.weight", (hidden, q_out), shard_dim=1, tp=tp))
            if layer.o_proj.bias is not None:
                put(layer.o_proj.bias, vector(f"{a}.o_proj.bias", hidden))
            if layer.q_norm is not None:
                put(layer.q_norm.weight, vector(f"{a}.q_norm.weight", d))
                put(layer.k_norm.weight, vector(f"{a}.k_norm.weight", d))
            gate_up = [columns(f"{p}.mlp.gate_proj.weight", inter), columns(f"{p}.mlp.up_proj.weight", inter)]
            put(layer.gate_up_proj.weight, torch.cat(gate_up))
            put(layer.down_proj.weight, reader.read(f"{p}.mlp.down_proj.weight", (hidden, inter), shard_dim=1, tp=tp))
