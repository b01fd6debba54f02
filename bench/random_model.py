"""Bigger random-weight Llama models for the benches where kernels, not per-step overhead, decide (the tiny model is
overhead-bound): the tiny model's tokenizer and chat template, Hugging Face's initialisation, built offline once
into the Pie cache (``<cache>/models/random-llama-<shape>``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pie_workers.cache import build_once, cache_root
from pie_workers.tiny_model import default_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def random_llama(hidden: int = 1024, layers: int = 8, heads: int = 16, kv_heads: int = 8, max_len: int = 4096) -> Path:
    """A Llama of the given shape with random weights (intermediate size 2.75x hidden, head size hidden / heads)."""
    final = cache_root() / "models" / f"random-llama-h{hidden}-l{layers}-a{heads}-kv{kv_heads}"

    def build(out_dir: Path) -> Path:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        tiny = default_model_path("llama")
        vocab = LlamaConfig.from_pretrained(tiny).vocab_size
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(hidden * 2.75) // 64 * 64,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_len,
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
        for name in TOKENIZER_FILES:
            if (tiny / name).exists():
                shutil.copy(tiny / name, out_dir / name)
        return out_dir

    return build_once(final, build)
