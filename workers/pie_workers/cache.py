"""This node's cache for Pie's own files (embedded models, adapters, fetched tokenizer files).

Per node by design: a cluster's nodes need not share a disk, so what one node caches another finds or fetches again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

COMPLETE = ".pie-build-complete"  # written last into a built directory: one without it is never used


def cache_root() -> Path:
    """``$PIE_CACHE_DIR`` if set, else ``~/.cache/pie``."""
    return Path(os.environ.get("PIE_CACHE_DIR") or Path.home() / ".cache" / "pie").expanduser()


def build_once(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, built by ``build(directory)`` first if it is not complete yet.

    The build goes to a temporary sibling that is renamed into place after its completion marker is written, so
    readers never see a partial directory, and a concurrent builder that wins the race is simply reused.
    """
    if (final / COMPLETE).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700, which would hide the cache from other users
    try:
        build(tmp)
        (tmp / COMPLETE).write_text("complete\n", encoding="utf-8")
        if final.exists() and not (final / COMPLETE).exists():
            shutil.rmtree(final, ignore_errors=True)  # a leftover without a marker is never complete
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / COMPLETE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
