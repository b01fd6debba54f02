"""How a model runner is set up (pool size, dtype, device, kernels): read by the cluster's config and the
controller, which never import torch, and by the runner, which does."""

from __future__ import annotations

from dataclasses import dataclass

from pie_workers.backends import check_backend

COMPILE_MODES = ("off", "on", "auto")
DEFAULT_COMPILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class RunnerSettings:
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; otherwise memory_fraction of free memory
    memory_fraction: float = 0.5
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on GPU
    device: str | None = None  # default: cuda if available
    adapter_dir: str | None = None  # root of users' LoRA adapter files; default: peft_format.default_root()
    host_pages: int | None = None  # host-memory pages for suspended contexts' KV; default: as many as the pool
    backend: str = "auto"  # "torch": plain torch; "vllm": vLLM's kernels; "auto": resolve_backend() picks one
    compile: str = "auto"  # decode steps through graphs (decode_graphs): "auto" (CUDA graphs on one GPU), "on", "off"
    compile_sizes: tuple[int, ...] = DEFAULT_COMPILE_SIZES  # the batch sizes decode steps are padded to, one graph each

    def __post_init__(self) -> None:
        check_backend(self.backend, self.page_size)
        check_compile(self.compile, self.compile_sizes)


def check_compile(mode: str, sizes: tuple[int, ...]) -> None:
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"compile sizes must be positive batch sizes, got {sizes}")
