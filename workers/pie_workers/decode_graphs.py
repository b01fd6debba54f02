"""Which graphs a runner's plain decode steps run through, made when it starts: CUDA graphs on one GPU rank of the
torch backend (``cuda_graph_step``), ``torch.compile`` on a CPU (``compiled_step``), or none (eager)."""

from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING

from pie_workers.compiled_step import CompiledDecode
from pie_workers.kv_pool import KVPool
from pie_workers.models.llama import LlamaModel
from pie_workers.vllm_kv_pool import VllmCpuKVPool

if TYPE_CHECKING:
    from pie_workers.cuda_graph_step import CudaGraphDecode


def compiled_decode(
    mode: str, sizes: tuple[int, ...], model: LlamaModel, kv: object, world_size: int
) -> CompiledDecode | CudaGraphDecode | None:
    """A runner's decode step through graphs made now, or None. On one GPU rank of the torch backend, CUDA graphs
    (``cuda_graph_step``): "on" and "auto". On a CPU, ``torch.compile``: "on" only, since it is no faster on the
    default backend there and takes tens of seconds to start. "on" where neither is supported is an error."""
    if mode == "off":
        return None
    if world_size == 1 and _device(kv) == "cuda":
        from pie_workers.cuda_graph_step import CudaGraphDecode  # imports triton, which a CPU-only host may lack
        from pie_workers.triton_kv_pool import TritonKVPool

        if isinstance(kv, TritonKVPool):
            graphs = CudaGraphDecode(model, kv, sizes)
            with _no_collection():
                graphs.capture()
            return graphs
    elif mode == "on" and _compiles_on_cpu(kv, world_size):
        compiled = CompiledDecode(model, kv, sizes)
        with _no_collection():
            compiled.warm_up()
        return compiled
    if mode == "on":
        raise ValueError(
            f"decode graphs need a single rank: on a GPU the torch backend's pool, on a CPU a pool whose kernels "
            f"take the model (got {type(kv).__name__} on {_device(kv)}, tensor-parallel size {world_size})"
        )
    return None


@contextlib.contextmanager
def _no_collection():
    """Garbage collected before graphs are made, and not while: a finalizer that runs inside dynamo's trace (vLLM's
    oneDNN GEMM handlers of an earlier runner in the process call ``.item()``) runs under its fake tensors, fails
    and unwinds its modes, and the graphs made then guard on tensors of another mode: every later step missed them
    (seen in CI, after a test's earlier runners were dropped)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _device(kv: object) -> str:
    return kv.k.device.type if isinstance(kv, KVPool) else "cpu"  # (the vllm backend's CPU pool is no KVPool)


def _compiles_on_cpu(kv: object, world_size: int) -> bool:
    """A single rank on a CPU pool whose kernels take the model (collectives are not compiled)."""
    if world_size != 1:
        return False
    if isinstance(kv, VllmCpuKVPool):
        return kv.kernel_writes and kv.kernel_attends
    return type(kv) is KVPool and kv.k.device.type == "cpu"
