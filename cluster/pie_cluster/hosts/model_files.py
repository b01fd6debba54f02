"""A served model's tokenizer and template files on the node of each inferlet that uses the model.

The SDK reads a model's tokenizer and chat template from a directory (``ModelEndpoint.model_dir``), and that
directory is the replica's, on the replica's node. An inferlet host on a node that lacks it fetches the files
through Ray (``RankWorker.model_files``), writes them once into this node's cache under a name derived from their
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


async def local_endpoints(endpoints: dict[str, ModelEndpoint], sources: dict[str, object]) -> dict[str, ModelEndpoint]:
    """``endpoints`` with each model_dir replaced by a directory that exists on this node: the replica's own when it
    is here, else a copy of its files fetched from ``sources`` (model name -> Ray reference to
    ``RankWorker.model_files``)."""
    return {name: replace(e, model_dir=await _local_directory(name, e, sources)) for name, e in endpoints.items()}


async def _local_directory(name: str, endpoint: ModelEndpoint, sources: dict[str, object]) -> str:
    model_dir = endpoint.model_dir
    if all((Path(model_dir) / f).is_file() for f in NEEDED):
        return model_dir
    if name not in sources:
        raise FileNotFoundError(f"model {name!r}: {model_dir} is not on this node and no copy was offered")
    return str(await asyncio.to_thread(write_files, await sources[name]))


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
