"""Reads Hugging Face safetensors checkpoints (one file or a sharded index), one tensor shard at a time.

Each tensor-parallel rank reads only its own rows/columns through safetensors' lazy slices, so a rank never holds
the full weight of a split layer. Missing files or tensors and shape mismatches raise ``CheckpointError`` naming the
file and the tensor.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from pie_workers.parallel import TensorParallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """The checkpoint on disk is incomplete or does not match the model's config."""


class CheckpointReader:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._where = self._index()
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def _index(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            for file in sorted(set(weight_map.values())):
                if not (self.model_dir / file).is_file():
                    raise CheckpointError(f"{self.model_dir / file}: shard named by {INDEX_FILE} is missing")
            return weight_map
        files = [self.model_dir / SINGLE_FILE] if (self.model_dir / SINGLE_FILE).is_file() else []
        files = files or sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors weights (and no {INDEX_FILE})")
        where: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), file.name))
        return where

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str):
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"{self.model_dir}: checkpoint is incomplete: tensor {name!r} not found")
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(self.model_dir / file, framework="pt"))
        return file, self._handles[file].get_slice(name)

    def read(
        self,
        name: str,
        shape: tuple[int, ...],
        shard_dim: int | None = None,
        tp: TensorParallel | None = None,
    ) -> torch.Tensor:
        """Read ``name`` (whose full shape must be ``shape``), keeping only this rank's part of ``shard_dim``."""
        file, slc = self._slice(name)
        actual = tuple(slc.get_shape())
        if actual != tuple(shape):
            raise CheckpointError(
                f"{self.model_dir / file}: tensor {name!r} has shape {list(actual)}, config implies {list(shape)}"
            )
        if shard_dim is None or tp is None or tp.world_size == 1:
            return slc[:]
        start, end = tp.shard_range(shape[shard_dim])
        index = tuple(slice(start, end) if d == shard_dim else slice(None) for d in range(len(shape)))
        return slc[index]

    def read_rows(self, name: str, shape: tuple[int, int], start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of a 2-D tensor, zero-padded past its end (for a padded, split vocabulary)."""
        file, slc = self._slice(name)
        if tuple(slc.get_shape()) != tuple(shape):
            raise CheckpointError(
                f"{self.model_dir / file}: tensor {name!r} has shape {list(slc.get_shape())}, "
                f"config implies {list(shape)}"
            )
        rows = slc[start : min(end, shape[0])]
        if rows.shape[0] < end - start:
            rows = torch.cat([rows, rows.new_zeros(end - start - rows.shape[0], shape[1])])
        return rows
