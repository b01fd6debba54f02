"""Deterministic, offline builder of the project's embedded default model: a tiny random-weight HF checkpoint.

Why: tests, demos and CI need a genuine Hugging Face model directory (config, byte-level BPE tokenizer with a
ChatML template, safetensors weights) without network access or data downloads. The output is byte-identical
on every run and host, so caches can be keyed by `BUILD_VERSION` and parity tests can trust a file hash.

Heavy libraries (torch, transformers, tokenizers) are imported inside functions so that importing this module
stays cheap for callers that only need `default_model_path` of an already-built model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pie_workers.cache import build_once, cache_root

# Bump whenever the bytes written by `build_tiny_model` change, so stale caches are not reused.
BUILD_VERSION = "v1"

Arch = Literal["llama", "qwen3"]

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WEIGHT_STD = 0.02
_NORM_JITTER = 0.1

_COMMON_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "dtype": "float32",
}


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE on the fixed corpus once per process; both architectures share it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from pie_workers.corpus import corpus_lines

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"corpus too small: {tokenizer.get_vocab_size()} tokens, {VOCAB_SIZE} needed")
    return tokenizer.to_str()


def _save_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=SPECIAL_TOKENS[EOS_TOKEN_ID],
        pad_token=SPECIAL_TOKENS[PAD_TOKEN_ID],
        bos_token=None,
        model_max_length=_COMMON_CONFIG["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)


def _config(arch: Arch):
    """The HF config object, so config.json is genuine HF format (including `rope_parameters`)."""
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            **_COMMON_CONFIG,
            architectures=["LlamaForCausalLM"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        )
    if arch == "qwen3":
        from transformers import Qwen3Config

        # head_dim * heads != hidden_size on purpose: exercises an explicit head_dim.
        return Qwen3Config(
            **_COMMON_CONFIG,
            architectures=["Qwen3ForCausalLM"],
            head_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    raise ValueError(f"unknown arch {arch!r}; expected 'llama' or 'qwen3'")


def _weights(config, seed: int) -> dict:
    """Fill every tensor ourselves, in sorted-key order, from one seeded generator.

    HF's init is not used because it changes between releases. Normals are drawn in float64 because torch's
    float32 `normal_` takes a SIMD path whose bits differ between CPU capabilities (AVX2 vs default); the
    float64 path is scalar, so the bytes are the same on every x86 host. Norm weights are 1 + 0.1*N(0, 1)
    rather than 1 so that a norm the runtime forgets to load shows up in parity tests.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # HF re-ties it to embed_tokens on load

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        noise = torch.empty(shapes[name], dtype=torch.float64).normal_(generator=generator)
        if name.endswith("norm.weight"):
            value = 1.0 + _NORM_JITTER * noise
        elif name.endswith(".weight") and noise.dim() == 2:
            value = _WEIGHT_STD * noise
        else:
            raise ValueError(f"no initialisation rule for parameter {name!r} with shape {shapes[name]}")
        tensors[name] = value.to(torch.float32).contiguous()
    return tensors


def build_tiny_model(out_dir: Path, arch: Arch = "llama", seed: int = 0) -> Path:
    """Write the tiny model (config, generation config, tokenizer, weights) into `out_dir` and return it."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(arch)
    # to_json_string() writes the sorted diff against defaults, as save_pretrained does, minus its I/O.
    (out_dir / "config.json").write_text(config.to_json_string(), encoding="utf-8")
    generation = GenerationConfig(bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    (out_dir / "generation_config.json").write_text(generation.to_json_string(), encoding="utf-8")
    _save_tokenizer(out_dir)
    weights = out_dir / "model.safetensors"
    save_file(_weights(config, seed), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it 0600; other users (e.g. a container's runtime user) read it
    return out_dir


def default_model_path(arch: Arch = "llama") -> Path:
    """Return the cached default model for `arch`, building it once (atomically, see `cache.build_once`) if it is
    not there yet: `<cache root>/models/tiny-<arch>-<BUILD_VERSION>`."""
    final = cache_root() / "models" / f"tiny-{arch}-{BUILD_VERSION}"
    return build_once(final, lambda out_dir: build_tiny_model(out_dir, arch=arch))


@dataclass(frozen=True)
class EmbeddedModel:
    """The embedded model named by its architecture rather than by a path.

    A path is only true on the node that built it; a replica placed on another node resolves this name there,
    finding or building its own byte-identical copy.
    """

    arch: Arch = "llama"

    def local_path(self) -> Path:
        return default_model_path(self.arch)
