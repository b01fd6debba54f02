"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV pool, tensor-parallel aware.

Attention heads and MLP columns are split across ranks; q/k/v and gate/up are fused into single matmuls. Weight
names follow the Hugging Face checkpoints, so ``load`` reads them directly (each rank only its shard).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pie_workers.batch_plan import BatchPlan
from pie_workers.config import ModelConfig
from pie_workers.kv_pool import KVPool
from pie_workers.layers.attention import paged_attention
from pie_workers.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pie_workers.layers.norm import RMSNorm
from pie_workers.layers.rope import RotaryEmbedding, apply_rotary
from pie_workers.loader import CheckpointReader
from pie_workers.parallel import TensorParallel


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, index: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.index = index
        self.window = cfg.layer_windows[index]
        d = cfg.head_dim
        self.local_heads = cfg.num_heads // tp.world_size
        self.local_kv_heads = cfg.num_kv_heads // tp.world_size
        self.head_dim = d
        self.scale = d**-0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, tp
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, h, cos, sin, plan: BatchPlan, kv: KVPool) -> torch.Tensor:
        T, d = h.shape[0], self.head_dim
        q, k, v = self.qkv_proj(self.input_layernorm(h)).split(
            [self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d], dim=-1
        )
        q, k, v = q.view(T, -1, d), k.view(T, -1, d), v.view(T, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv.write(self.index, plan.write_slots, k, v)
        attn = paged_attention(q, kv.k[self.index], kv.v[self.index], plan, self.window, self.scale)
        h = h + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, reader: CheckpointReader):
        super().__init__()
        if cfg.num_heads % tp.world_size or cfg.num_kv_heads % tp.world_size:
            raise ValueError(
                f"{cfg.num_heads} attention heads / {cfg.num_kv_heads} KV heads cannot be split over "
                f"tensor-parallel size {tp.world_size}"
            )
        self.cfg, self.tp = cfg, tp
        attn = "model.layers.0.self_attn"
        qkv_bias, o_bias = reader.has(f"{attn}.q_proj.bias"), reader.has(f"{attn}.o_proj.bias")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, tp, i, qkv_bias, o_bias) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan, kv: KVPool) -> torch.Tensor | None:
        """Runs every token of the plan; returns logits ``[N, vocab]`` of ``plan.logit_rows`` on the leader."""
        kv.copy_slots(plan.copy_src, plan.copy_dst)
        h = self.embed_tokens(plan.token_ids)
        cos, sin = self.rotary.cos_sin(plan.positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, plan, kv)
        h = self.norm(h[plan.logit_rows])
        logits = self.lm_head(h)
        return None if logits is None else logits.float()

    def load(self, reader: CheckpointReader, show_progress: bool) -> None:
        """Fill every parameter from the checkpoint (this rank's shards only)."""
        cfg, tp = self.cfg, self.tp
        H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        emb = self.embed_tokens
        steps = [
            (emb.weight, lambda: reader.read_rows("model.embed_tokens.weight", (cfg.vocab_size, H), emb.start, emb.end)),
            (self.lm_head.weight, lambda: reader.read_rows(head, (cfg.vocab_size, H), emb.start, emb.end)),
            (self.norm.weight, lambda: reader.read("model.norm.weight", (H,))),
        ]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            col = lambda name, rows, cols=H: reader.read(name, (rows, cols), 0, tp)
            steps += [
                (layer.input_layernorm.weight, lambda p=p: reader.read(f"{p}.input_layernorm.weight", (H,))),
                (layer.post_attention_layernorm.weight,
                 lambda p=p: reader.read(f"{p}.post_attention_layernorm.weight", (H,))),
                (layer.qkv_proj.weight, lambda a=a: torch.cat(
                    [col(f"{a}.q_proj.weight", q_out), col(f"{a}.k_proj.weight", kv_out),
                     col(f"{a}.v_proj.weight", kv_out)])),
                (layer.o_proj.weight, lambda a=a: reader.read(f"{a}.o_proj.weight", (H, q_out), 1, tp)),
                (layer.gate_up_proj.weight, lambda p=p: torch.cat(
                    [col(f"{p}.mlp.gate_proj.weight", I), col(f"{p}.mlp.up_proj.weight", I)])),
                (layer.down_proj.weight, lambda p=p: reader.read(f"{p}.mlp.down_proj.weight", (H, I), 1, tp)),
            ]
            if layer.qkv_proj.bias is not None:
                steps.append((layer.qkv_proj.bias, lambda a=a: torch.cat([
                    reader.read(f"{a}.q_proj.bias", (q_out,), 0, tp), reader.read(f"{a}.k_proj.bias", (kv_out,), 0, tp),
                    reader.read(f"{a}.v_proj.bias", (kv_out,), 0, tp)])))
            if layer.o_proj.bias is not None:
                steps.append((layer.o_proj.bias, lambda a=a: reader.read(f"{a}.o_proj.bias", (H,))))
            if layer.q_norm is not None:
                steps.append((layer.q_norm.weight, lambda a=a: reader.read(f"{a}.q_norm.weight", (d,))))
                steps.append((layer.k_norm.weight, lambda a=a: reader.read(f"{a}.k_norm.weight", (d,))))
        for param, read in tqdm(steps, desc="loading weights", unit="tensor", disable=not show_progress):
            param.data = read().to(dtype=param.dtype, device=param.device).contiguous()
