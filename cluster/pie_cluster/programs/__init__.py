"""Inferlet programs: what users upload, how a host turns one into ``main``, the store that keeps them, and
the cluster's built-in programs (``builtin/``, source files loaded like any upload)."""

from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "builtin"
"""The cluster's own programs, as source files."""
