"""The model runner of one tensor-parallel rank: a stateless ``execute(batch) -> outputs`` over a paged KV pool.

The leader (rank 0) plans each batch, broadcasts the plan, runs its share of the forward, and samples; followers
loop in ``follow`` running the same forwards. No per-request state survives a batch: page tables, lengths and
lineage are the replica engine's business.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pie_workers import sampling
from pie_workers.adapters import AdapterStore, LoraAdapter, LoraConfig
from pie_workers.backends import resolve_backend
from pie_workers.batch_checks import BatchError
from pie_workers.batch_plan import BatchPlan, PlannedBatch, RequestSampling, plan_batch
from pie_workers.config import ModelConfig
from pie_workers.decode_graphs import compiled_decode
from pie_workers.kv_pool import KVPool, PoolShape, page_bytes, pages_for_memory_fraction
from pie_workers.layers import vllm_ops
from pie_workers.layers.linear import TorchPackedLinear
from pie_workers.layers.lora import ModuleWeights
from pie_workers.loader import CheckpointReader
from pie_workers.models.llama import LlamaModel
from pie_workers.parallel import TensorParallel
from pie_workers.runner_settings import RunnerSettings
from pie_workers.vllm_cuda_kv_pool import VllmCudaKVPool
from pie_workers.vllm_kv_pool import VllmCpuKVPool
from pie_workers.wire.batch import ForwardBatch, RequestOutput, Slot, SlotOutput

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class GroupBroken(RuntimeError):
    """A forward pass of a tensor-parallel group failed after the plan went out (a rank died, or one stopped inside
    a collective): no later pass of this group can succeed, so its replica must be replaced, not answer errors."""


@dataclass(frozen=True, slots=True)
class RankCall:
    """What the leader has every follower do besides a forward pass: an adapter change (an ``AdapterStore`` method)
    or a handover's page read or write (``read_pages``, ``write_pages``)."""

    method: str
    args: tuple


def resolve_device(settings: RunnerSettings) -> torch.device:
    return torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _resolve_device_dtype(settings: RunnerSettings) -> tuple[torch.device, torch.dtype]:
    device = resolve_device(settings)
    name = settings.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return device, DTYPES[name]


def onednn_bf16() -> bool:
    """Whether this CPU has the instructions oneDNN's bf16 matmuls need."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pool_class(backend: str, device: torch.device) -> type:
    """Each backend's pool for the device: on a GPU the torch backend attends with its Triton kernel."""
    if backend == "vllm":
        return VllmCudaKVPool if device.type == "cuda" else VllmCpuKVPool
    if device.type == "cuda":
        from pie_workers.triton_kv_pool import TritonKVPool  # imports triton, which a CPU-only host may lack

        return TritonKVPool
    return KVPool


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        settings: RunnerSettings = RunnerSettings(),
        tp: TensorParallel = TensorParallel(),
        show_progress: bool = False,
    ):
        self.cfg = ModelConfig.from_dir(model_dir)
        self.model_dir = str(model_dir)
        self.device, self.dtype = _resolve_device_dtype(settings)
        settings = replace(settings, backend=resolve_backend(settings.backend, settings.page_size, self.device.type))
        self.settings, self.tp = settings, tp
        with CheckpointReader(model_dir) as reader:
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with self.device:
                    self.model = LlamaModel(self.cfg, tp, reader, use_vllm_ops=settings.backend == "vllm")
            finally:
                torch.set_default_dtype(default_dtype)
            self.model.load(reader, show_progress and tp.is_leader)
        self._pack_linear_weights()
        local_kv_heads = self.cfg.num_kv_heads // tp.world_size
        num_pages = settings.num_pages
        if num_pages is None:
            per_page = page_bytes(self.cfg, settings.page_size, local_kv_heads, self.dtype)
            num_pages = pages_for_memory_fraction(settings.memory_fraction, per_page, self.device)
            num_pages = tp.broadcast_object(num_pages)  # every rank must agree on the pool size
        host_pages = num_pages if settings.host_pages is None else settings.host_pages
        shape = PoolShape(self.cfg, num_pages, settings.page_size, local_kv_heads, self.dtype, self.device, host_pages)
        self.kv = _pool_class(settings.backend, self.device)(shape)
        self.adapters = AdapterStore(self.cfg, tp, self.device, self.dtype)
        start = time.perf_counter()
        self.compiled = compiled_decode(settings.compile, settings.compile_sizes, self.model, self.kv, tp.world_size)
        self.graphs_seconds = time.perf_counter() - start

    def _pack_linear_weights(self) -> None:
        """On a CPU the matmuls run over weights packed once for oneDNN: vLLM's op for the vllm backend (every
        projection), torch's own for the torch backend (projections of 2^18 weights or more: on the tiny model's
        128 x 256 ones F.linear is faster). On a GPU, cuBLAS needs no packing; in bf16 on a CPU without oneDNN's
        bf16 instructions (AVX-512 or AVX-NE-CONVERT; e.g. an AVX2-only one) neither packer works, so none packs."""
        if self.device.type != "cpu" or (self.dtype == torch.bfloat16 and not onednn_bf16()):
            return
        if self.settings.backend == "vllm" and vllm_ops.onednn_available():
            self.model.pack_linear_weights(vllm_ops.PackedLinear)
        elif self.settings.backend == "torch" and torch.backends.mkldnn.is_available():
            self.model.pack_linear_weights(TorchPackedLinear, min_elements=1 << 18)

    @property
    def decode_graphs(self) -> str:
        """How decode steps run, for ``pie status``: "eager", or which graphs, for which batch sizes, made in how
        long (a replica's start pays it)."""
        if self.compiled is None:
            return "eager"
        sizes = self.compiled.sizes
        return f"{self.compiled.kind} {sizes[0]}-{sizes[-1]} ({len(sizes)} sizes, {self.graphs_seconds:.1f} s)"

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> list[RequestOutput]:
        """Leader only. Malformed requests come back with ``error`` set; the others run normally."""
        kv = self.kv
        compiled = self.compiled if self.compiled is not None and self.compiled.accepts(batch) else None
        planned = plan_batch(
            batch, kv.page_size, kv.num_pages, self.cfg.vocab_size, self.adapters.ids(), kv.host_pages,
            paged_requests=kv.needs_paged_requests or compiled is not None,
            kernel_attends_all=kv.kernel_attends_all or compiled is not None,
        )  # fmt: skip
        outputs = [RequestOutput() for _ in batch.requests]
        for i, msg in planned.errors.items():
            outputs[i].error = msg
        self._move_host_pages(planned.plan)
        if planned.plan.num_tokens == 0:
            self.kv.copy_pages(planned.plan.copy_src.to(self.device), planned.plan.copy_dst.to(self.device))
            self.tp.broadcast_object(planned.plan)
            return outputs
        try:
            self.tp.broadcast_object(planned.plan)
            if compiled is not None:  # it moves what it needs to the device itself
                logits = compiled(planned.plan)
            else:
                plan = planned.plan.to(self.device)
                logits = self.model(plan, self.kv, self.adapters.batch_lora(plan.lora_groups))
        except Exception as e:
            if self.tp.world_size > 1:  # the ranks are out of step for good (one died, or stopped in a collective)
                raise GroupBroken(f"the tensor-parallel group failed in a forward pass: {e}") from e
            raise
        self._sample(planned, logits, outputs)
        return outputs

    @torch.inference_mode()
    def follow(self) -> None:
        """Follower ranks: run every plan and ``RankCall`` (an adapter change, a handover's pages) the leader
        broadcasts until it sends None."""
        while (message := self.tp.broadcast_object()) is not None:
            if isinstance(message, RankCall):
                self._follow_call(message)
                continue
            plan = message.to(self.device)
            self._move_host_pages(plan)
            if plan.num_tokens == 0:
                self.kv.copy_pages(plan.copy_src, plan.copy_dst)
            else:
                self.model(plan, self.kv, self.adapters.batch_lora(plan.lora_groups))

    def _move_host_pages(self, plan: BatchPlan) -> None:
        """Offloads, then restores: a page offloaded in this batch may be the one a restore refills."""
        if (moves := plan.host_moves) is not None:
            self.kv.move_to_host(moves.offload_pages, moves.offload_slots)
            self.kv.move_from_host(moves.restore_slots, moves.restore_pages)

    def _follow_call(self, call: RankCall) -> None:
        if call.method == "read_pages":
            (pages,) = call.args
            self.tp.gather_ranks(self.kv.read_pages(pages).to(self.device))
        elif call.method == "write_pages":
            (pages,) = call.args
            self.kv.write_pages(pages, self.tp.scatter_ranks(None, self._pages_buffer(len(pages))))
        else:
            getattr(self.adapters, call.method)(*call.args)

    def stop_followers(self) -> None:
        self.tp.broadcast_object(None)

    # -- pages a handover moves (engine/transfer.py): every rank's share of the KV heads ---------------------------

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """Leader: ``pages`` as every rank holds them, ``[pages, ranks, *one rank's page]`` in host memory."""
        self.tp.broadcast_object(RankCall("read_pages", (pages,)))
        return self.tp.gather_ranks(self.kv.read_pages(pages).to(self.device)).cpu()

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Leader: install pages ``read_pages`` gave (of a group of the same size and layout) into ``pages``."""
        if data.shape[:2] != (len(pages), self.tp.world_size):
            raise ValueError(f"pages of shape {tuple(data.shape)} for {len(pages)} pages of {self.tp.world_size} ranks")
        self.tp.broadcast_object(RankCall("write_pages", (pages,)))
        self.kv.write_pages(pages, self.tp.scatter_ranks(data.to(self.device), self._pages_buffer(len(pages))))

    def _pages_buffer(self, n: int) -> torch.Tensor:
        """Room for ``n`` of this rank's pages as its pool reads them."""
        none = self.kv.read_pages([])  # the shape and type of this rank's pages, with none copied
        return none.new_empty((n, *none.shape[1:]), device=self.device)

    # -- adapters (leader): each change is applied here first, so a bad one raises before any rank sees it ---------

    def create_adapter(self, adapter_id: int, config: LoraConfig, sigma: float) -> None:
        """A fresh adapter (PEFT's init: B = 0) from one seed every rank shares."""
        self._on_every_rank("create", adapter_id, config, secrets.randbits(63), sigma)

    def replace_adapter(self, adapter_id: int, config: LoraConfig, weights: ModuleWeights) -> None:
        """New matrices and configuration (e.g. read from a PEFT directory) for an adapter; its zo sigma stays."""
        self._on_every_rank("put", adapter_id, LoraAdapter(config, weights, self.adapters.get(adapter_id).sigma))

    def fork_adapter(self, src: int, dst: int) -> None:
        self._on_every_rank("fork", src, dst)

    def drop_adapter(self, adapter_id: int) -> None:
        self._on_every_rank("drop", adapter_id)

    def _on_every_rank(self, method: str, *args) -> None:
        getattr(self.adapters, method)(*args)
        self.tp.broadcast_object(RankCall(method, args))

    def _sample(self, planned: PlannedBatch, logits: torch.Tensor, outputs: list[RequestOutput]) -> None:
        """Evaluate every slot; with drafts, also sample each draft row with the verifying sampler."""
        plans = planned.sampling
        for rs in plans:
            for m in rs.masked_rows:
                first = rs.first_row + m.first
                logits[first : first + m.count] += m.penalty.to(logits.device)
        slots = _per_position_seeds(planned, [s for rs in plans for s in _row_slots(rs)])
        results = sampling.run_slots(logits, slots) if slots else []
        cursor = 0
        for rs in plans:
            mine = results[cursor : cursor + rs.num_rows]
            cursor += rs.num_rows
            out = outputs[rs.index]
            out.slots = mine[: len(rs.slots)]
            if rs.draft_tokens:
                out.tokens = _verify(rs.draft_tokens, out.slots[rs.verify_slot], mine[len(rs.slots) :])


def _per_position_seeds(planned: PlannedBatch, slots: list[Slot]) -> list[Slot]:
    """A seeded sampler draws from (seed, token position): runs replay exactly, yet successive steps of one
    generation — same seed, next position — draw fresh noise instead of repeating the same token."""
    if not any(s.seed and s.kind.is_token for s in slots):
        return slots
    positions = planned.plan.positions[planned.plan.logit_rows].tolist()
    return [
        replace(s, seed=(s.seed * 0x9E3779B97F4A7C15 + p + 1) % (1 << 63) or 1) if s.seed and s.kind.is_token else s
        for s, p in zip(slots, positions, strict=True)
    ]


def _row_slots(rs: RequestSampling) -> list:
    """The slot evaluated on each of the request's logit rows."""
    return rs.slots + [rs.slots[rs.verify_slot]] * len(rs.draft_tokens) if rs.draft_tokens else rs.slots


def _verify(drafts: list[int], first: SlotOutput, after_drafts: list[SlotOutput]) -> list[int]:
    """Accept the longest prefix of drafts the sampler agrees with, plus the sampler's token after it."""
    sampled = [first.token] + [o.token for o in after_drafts]
    accepted: list[int] = []
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        accepted.append(draft)
    return accepted + [sampled[len(accepted)]]


__all__ = ["BatchError", "ModelRunner", "RunnerSettings"]
