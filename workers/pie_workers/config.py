"""The model hyper-parameters the runner needs, read from a Hugging Face ``config.json``.

One decoder implementation serves the Llama, Mistral, Qwen2 and Qwen3 families; the families differ only in the
flags below (q/k norm, tied embeddings, sliding windows, explicit head_dim, rope scaling) and in
which bias tensors their checkpoints carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture or configuration the runner does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the HF class name, e.g. "LlamaForCausalLM"
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]  # per layer: sliding-window size in tokens, None = full attention
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        return ModelConfig.from_dict(json.loads(path.read_text()), source=str(path))

    @staticmethod
    def from_dict(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_config(cfg, source),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=family == "qwen3",
            layer_windows=_layer_windows(cfg, family),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )


def _layer_windows(cfg: dict[str, Any], family: str) -> tuple[int | None, ...]:
    """Mistral slides every layer; Qwen marks sliding layers in ``layer_types`` (when ``use_sliding_window``)."""
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if family == "mistral":
        return (window,) * n
    types = cfg.get("layer_types")
    if window and cfg.get("use_sliding_window") and types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * n


def _rope_config(cfg: dict[str, Any], source: str) -> RopeConfig:
    """Read both forms: transformers 5's ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope_type {rope_type!r}; supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
