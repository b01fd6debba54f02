"""Adapters on disk in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``), and where a user's
adapter files live on a replica's node.

Files written here load with ``PeftModel.from_pretrained`` on the Hugging Face model, and an adapter PEFT saved for
a Llama-family model loads here. Every user has one directory (``<root>/<username>``); the paths inferlets name are
relative to it and cannot leave it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pie_workers.adapters import LoraAdapter, LoraConfig
from pie_workers.cache import cache_root
from pie_workers.layers.lora import PEFT_MODULES, ModuleWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# LoRA features that change the forward beyond x A^T B^T * scale: refused rather than silently ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out",
    "lora_bias": "LoRA bias",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication",
}


def default_root() -> Path:
    """``$PIE_CACHE_DIR/adapters``, else ``~/.cache/pie/adapters``."""
    return cache_root() / "adapters"


def user_path(root: Path, username: str, path: str) -> Path:
    """``path`` inside ``username``'s adapter directory; ValueError for anything that could point elsewhere."""
    if username in ("", ".", "..") or "/" in username or "\\" in username:
        raise ValueError(f"user name {username!r} cannot name an adapter directory")
    if not isinstance(path, str) or not path:
        raise ValueError(f"an adapter path must be a non-empty string, got {path!r}")
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or "\\" in path or "\x00" in path or ".." in parts:
        raise ValueError(
            f"adapter path {path!r} must name a directory inside your adapter directory (relative, without '..' or "
            "backslashes)"
        )
    home = (root / username).resolve()
    full = (home / Path(*parts)).resolve()
    if not full.is_relative_to(home):
        raise ValueError(f"adapter path {path!r} leads outside your adapter directory (through a symlink)")
    return full


def peft_key(layer: int, module: str, matrix: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_BLOCK.get(module, 'mlp')}.{module}.lora_{matrix}.weight"


def write_adapter(adapter: LoraAdapter, directory: Path, base_model: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        tensors[peft_key(layer, module, "A")] = a.contiguous()
        tensors[peft_key(layer, module, "B")] = b.contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter.config
    (directory / CONFIG_FILE).write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base_model,
                "r": config.rank,
                "lora_alpha": config.alpha,
                "target_modules": list(config.targets),
                "use_rslora": config.rslora,
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "use_dora": False,
                "inference_mode": True,
            },
            indent=2,
        )
        + "\n"
    )


def read_adapter(directory: Path) -> tuple[LoraConfig, ModuleWeights]:
    """The adapter's configuration and full matrices (float32). Whether they fit a model is checked by the store."""
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ValueError(f"{file.name} is missing from the adapter directory {directory}")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: not a LoRA adapter (peft_type {raw.get('peft_type')!r})")
    for field, feature in _UNSUPPORTED.items():
        if raw.get(field):
            raise ValueError(f"{config_file}: {feature} is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: bias {raw['bias']!r} is not supported (only 'none')")
    try:
        tensors = load_file(str(weights_file))
    except SafetensorError as e:
        raise ValueError(f"{weights_file}: not a readable safetensors file ({e})") from None
    weights = _pair_matrices(tensors, weights_file)
    targets = tuple(sorted({module for _, module in weights}, key=PEFT_MODULES.index))
    try:
        config = LoraConfig(raw.get("r"), float(raw.get("lora_alpha", 8)), targets, bool(raw.get("use_rslora")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_file}: {e}") from None
    return config, weights


def _pair_matrices(tensors: dict[str, torch.Tensor], source: Path) -> ModuleWeights:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match[2] not in PEFT_MODULES:
            raise ValueError(f"{source}: tensor {key!r} is not a LoRA matrix of a supported module {PEFT_MODULES}")
        found.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    weights = {}
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise ValueError(f"{source}: layer {layer} {module} has no lora_{missing} matrix")
        weights[layer, module] = (pair["A"], pair["B"])
    if not weights:
        raise ValueError(f"{source}: holds no LoRA matrices")
    return weights
