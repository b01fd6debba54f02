"""A served model's tokenizer and template files on the node of each inferlet that uses the model.

The SDK reads a model's tokenizer and chat template from a directory (``ModelEndpoint.model_dir``), and that
directory is the replica's, on the replica's node. An inferlet host on a node that lacks it fetches the files
through Ray (``RankWorker.model_files``) once, writes them into this node's cache under a name derived from their
content, and points its inferlets there.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace
from pathlib import Path

from inferlet.runtime import ModelEndpoint
from pie_workers.cache import build_once, cache_root

NEEDED = ("config.json", "tokenizer.json")  # what the SDK cannot do without


class LocalModelFiles:
    """One host's view: ``sources`` maps a model name to a Ray reference to its files (``RankWorker.model_files``)."""

    def __init__(self, sources: dict[str, object]):
        self._sources = sources
        self._local: dict[str, str] = {}  # a replica's model_dir -> the directory holding its files on this node

    async def endpoints(self, endpoints: dict[str, ModelEndpoint]) -> dict[str, ModelEndpoint]:
        """``endpoints`` with each model_dir replaced by a directory that exists on this node."""
        return {name: replace(e, model_dir=await self._directory(name, e.model_dir)) for name, e in endpoints.items()}

    async def _directory(self, name: str, model_dir: str) -> str:
        if model_dir not in self._local:
            if all((Path(model_dir) / f).is_file() for f in NEEDED):
                self._local[model_dir] = model_dir
            elif name not in self._sources:
                raise FileNotFoundError(f"model {name!r}: {model_dir} is not on this node and no copy was offered")
            else:
                files = await self._sources[name]
                self._local[model_dir] = str(await asyncio.to_thread(write_files, files))
        return self._local[model_dir]


def write_files(files: dict[str, bytes], root: Path | None = None) -> Path:
    """Write ``files`` once into ``<root>/model-files/<digest of their names and bytes>`` (atomically, see
    ``cache.build_once``) and return that directory."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    final = (root or cache_root()) / "model-files" / digest.hexdigest()[:32]

    def write(directory: Path) -> None:
        for name, data in files.items():
            (directory / name).write_bytes(data)

    return build_once(final, write)
