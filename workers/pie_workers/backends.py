"""The attention backends a replica can run, and what each accepts; without torch, so the cluster's config can
check a model entry where it is read (importing torch there would slow every process that reads the config)."""

from __future__ import annotations

BACKENDS = ("torch", "vllm")


def kernel_variant(page_size: int) -> str:
    """The vLLM CPU kernels' ISA variant for a page size; any other page size is refused with the reason."""
    if page_size % 32 == 0:
        return "vec"
    if page_size == 16:
        return "vec16"
    raise ValueError(f"the vllm backend needs page_size 16 or a multiple of 32 (its CPU kernels), got {page_size}")


def check_backend(backend: str, page_size: int) -> None:
    """Refuse an unknown backend, or a page size the chosen one cannot take, with a message naming it."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "vllm":
        kernel_variant(page_size)
