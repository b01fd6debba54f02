"""Where a replica's model lives on its node, and the files besides the weights that inferlets need from it.

A cluster's nodes do not share a filesystem unless the operator made them: a path is resolved on the node of the
rank that loads it, and the tokenizer and chat-template files travel to inferlet hosts through Ray instead of by
path (see ``pie_cluster.hosts.model_files``).
"""

from __future__ import annotations

from pathlib import Path

from pie_workers.tiny_model import EmbeddedModel

ModelSource = str | Path | EmbeddedModel
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def local_model_dir(model: ModelSource, node: str = "this node") -> Path:
    """The model's directory here: the embedded model found or built in this node's cache, or the given path,
    which must hold a Hugging Face checkpoint on this node."""
    path = model.local_path() if isinstance(model, EmbeddedModel) else Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model at {path} on {node} (no config.json there): every node that runs a replica needs the "
            "model directory at that path (shared storage, or a copy per node)"
        )
    return path


def description_files(model_dir: str | Path) -> dict[str, bytes]:
    """The model's top-level files except its weights: config, tokenizer and chat template, what an inferlet's
    process reads (megabytes at most, where the weights are gigabytes)."""
    return {
        p.name: p.read_bytes()
        for p in sorted(Path(model_dir).iterdir())
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(WEIGHT_SUFFIXES)
    }
