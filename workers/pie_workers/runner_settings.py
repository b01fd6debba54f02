"""How a model runner is set up (pool size, dtype, device, kernels): read by the cluster's config and the
controller, which never import torch, and by the runner, which does."""

from __future__ import annotations

from dataclasses import dataclass

from pie_workers.backends import check_backend


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

    def __post_init__(self) -> None:
        check_backend(self.backend, self.page_size)
