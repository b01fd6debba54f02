"""The attention backends a replica can run, and what each accepts; without torch, so the cluster's config can
check a model entry where it is read (importing torch there would slow every process that reads the config)."""

from __future__ import annotations

import importlib.util

BACKENDS = ("torch", "vllm")
CHOICES = ("auto", *BACKENDS)  # what a config or command line may name; "auto" is resolved where the model runs


def kernel_variant(page_size: int) -> str:
    """The vLLM CPU kernels' ISA variant for a page size; any other page size is refused with the reason."""
    if page_size % 32 == 0:
        return "vec"
    if page_size == 16:
        return "vec16"
    raise ValueError(f"the vllm backend needs page_size 16 or a multiple of 32 (its CPU kernels), got {page_size}")


def check_backend(backend: str, page_size: int) -> None:
    """Refuse an unknown backend, or a page size the chosen one cannot take, with a message naming it."""
    if backend not in CHOICES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(CHOICES)}")
    if backend == "vllm":
        kernel_variant(page_size)


def resolve_backend(backend: str, page_size: int, device_type: str) -> str:
    """The backend ``auto`` stands for on this process's device: on a CPU, vLLM's kernels where vLLM is installed
    and take the page size (``bench/forward.py``: 1.2-3.6x the torch backend's decode on this project's models, and the
    served stack's swarm agents 1.4x at K = 32), else torch; on a GPU, torch, the backend tested there (the vllm
    backend's CUDA pool has not run on a GPU yet). A named backend is kept as it is."""
    if backend != "auto":
        return backend
    if device_type != "cpu" or importlib.util.find_spec("vllm") is None:
        return "torch"
    try:
        kernel_variant(page_size)
    except ValueError:
        return "torch"
    return "vllm"
