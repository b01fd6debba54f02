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
from pie_workers.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pie_workers.layers.lora import BatchLora, LoraSite
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

    def forward(self, h, cos, sin, plan: BatchPlan, kv: KVPool, lora: BatchLora | None) -> torch.Tensor:
        T, d = h.shape[0], self.head_dim

        def site(linear: str) -> LoraSite | None:
            return lora.at(self.index, linear) if lora is not None else None

        qkv = self.qkv_proj(self.input_layernorm(h), site("qkv_proj"))
        n_q, n_kv = self.local_heads, self.local_kv_heads
        if self.q_norm is None:  # rotate q and k together: they are adjacent in the fused projection
            qk = apply_rotary(qkv[:, : (n_q + n_kv) * d].view(T, n_q + n_kv, d), cos, sin)
            q, k = qk[:, :n_q], qk[:, n_q:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, : n_q * d].view(T, n_q, d)), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, n_q * d : (n_q + n_kv) * d].view(T, n_kv, d)), cos, sin)
        v = qkv[:, (n_q + n_kv) * d :].view(T, n_kv, d)
        kv.write(self.index, plan.write_slots, k, v)
        attn = kv.attend(self.index, q, plan, self.window, self.scale)
        h = h + self.o_proj(attn, site("o_proj"))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h), site("gate_up_proj")).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up, site("down_proj"))


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
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, tp, i, qkv_bias, o_bias) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)

    def forward(self, plan: BatchPlan, kv: KVPool, lora: BatchLora | None = None) -> torch.Tensor | None:
        """Runs every token of the plan; returns logits ``[N, vocab]`` of ``plan.logit_rows`` on the leader.

        ``lora``: the adapters of the batch's requests, each on its own token rows."""
        kv.copy_pages(plan.copy_src, plan.copy_dst)
        h = self.embed_tokens(plan.token_ids)
        cos, sin = self.rotary.cos_sin(plan.positions, plan.max_position, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, plan, kv, lora)
        h = self.norm(h if plan.every_row_has_logits else h[plan.logit_rows])
        logits = self.lm_head(h)
        return None if logits is None else logits.float()

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
