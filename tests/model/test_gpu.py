"""The CUDA path, for the day a GPU is lent (``make gpu-check`` runs these; without a GPU they are skipped, saying
why). The model code, the KV pool and the runner have CUDA branches that CPU runs never reach: bf16 weights and
pool, pinned host buffers for suspended pages, NCCL between tensor-parallel ranks, the torch backend's Triton
attention (against SDPA in ``test_triton_attention``) and the vllm backend's CUDA kernels (its pool against the torch
pool in ``test_vllm_kernels``); those two files' GPU tests are also marked ``gpu``.

Tolerance in bf16: its 8-bit mantissa rounds each value to ~0.4% of its size, and two implementations that sum in
a different order drift by a few of those steps per layer. So the check is on what a user sees — the most likely
token agrees at nearly every position (greedy decoding may legitimately diverge where two logits are within
rounding of each other) — and on logits within 0.1 absolute, about 25 bf16 steps of a logit of magnitude 3.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch
from support.paged import LOGITS, PageAllocator, Seq, request_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path cannot run here"),
]


NO_VLLM = "vLLM is not installed on this GPU host: the vllm backend needs its CUDA build (vllm==0.32.0)"


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("vllm", marks=pytest.mark.skipif(not importlib.util.find_spec("vllm"), reason=NO_VLLM))],
)
def test_bf16_logits_agree_with_transformers_on_the_gpu(tiny_llama, backend):
    """The vllm backend: FlashAttention over the paged cache, vLLM's fused RMSNorm, rotary and SiLU-and-mul."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    settings = RunnerSettings(num_pages=64, device="cuda", dtype="bfloat16", backend=backend)
    runner = ModelRunner(tiny_llama, settings)
    assert runner.kv.k.is_cuda and runner.kv.k.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).cuda().eval()
    tokens = [random.Random(0).randrange(runner.cfg.vocab_size) for _ in range(40)]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens], device="cuda")).logits[0].float().cpu().numpy()
    seq = Seq(tokens)
    out = runner.execute(ForwardBatch([request_for(seq, PageAllocator(64, 3), 16, [(i, LOGITS) for i in range(40)])]))
    got = np.stack([np.frombuffer(s.logits, dtype=np.float32) for s in out[0].slots])
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.95
    assert np.abs(got - expected).max() < 0.1


def test_the_default_backend_on_a_gpu_is_the_tested_torch_pool(tiny_llama):
    """``backend = "auto"`` (the default) must pick the backend the GPU tests cover, and decode as it does."""
    from support.paged import greedy_generate

    auto = ModelRunner(tiny_llama, RunnerSettings(num_pages=64, device="cuda"))
    assert auto.settings.backend == "torch"
    torch_runner = ModelRunner(tiny_llama, RunnerSettings(num_pages=64, device="cuda", backend="torch"))
    prompt = [random.Random(7).randrange(auto.cfg.vocab_size) for _ in range(21)]
    assert greedy_generate(auto, prompt, 12, PageAllocator(64)) == greedy_generate(
        torch_runner, prompt, 12, PageAllocator(64)
    )


def test_suspended_pages_wait_in_pinned_host_memory_and_come_back_intact(tiny_llama):
    runner = ModelRunner(tiny_llama, RunnerSettings(num_pages=8, device="cuda", host_pages=4))
    assert runner.kv.host_k.is_pinned() and runner.kv.host_v.is_pinned()
    runner.kv.k[:, 2].normal_()
    before = runner.kv.k[:, 2].clone()
    runner.kv.move_to_host(torch.tensor([2]), torch.tensor([1]))
    runner.kv.k[:, 2].zero_()
    runner.kv.move_from_host(torch.tensor([1]), torch.tensor([5]))
    torch.cuda.synchronize()
    assert torch.equal(runner.kv.k[:, 5], before)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")
def test_tp2_over_nccl_matches_one_gpu(tiny_llama, ray_session):
    from pie_workers.replica import Replica
    from support.paged import greedy_generate
    from test_tensor_parallel import ReplicaAsRunner

    settings = RunnerSettings(num_pages=64, device="cuda")
    single = ModelRunner(tiny_llama, settings)
    replica = Replica(tiny_llama, tensor_parallel_size=2, settings=settings, use_gpu=True)
    try:
        prompt = [random.Random(4).randrange(single.cfg.vocab_size) for _ in range(19)]
        got = greedy_generate(ReplicaAsRunner(replica), prompt, 16, PageAllocator(64))
        assert got == greedy_generate(single, prompt, 16, PageAllocator(64))
    finally:
        replica.shutdown()
