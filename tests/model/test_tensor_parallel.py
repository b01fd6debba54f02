"""Tensor parallelism on Ray: two rank actors over gloo give the single-rank answers, with either backend."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pie_workers.replica import Replica
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch
from support.paged import LOGITS, PageAllocator, Seq, greedy_generate, request_for


class ReplicaAsRunner:
    """Lets the sequence helpers drive a Ray replica exactly like an in-process runner."""

    def __init__(self, replica: Replica):
        self.replica, self.page_size = replica, replica.info.page_size

    def execute(self, batch):
        return self.replica.execute(batch)


@pytest.mark.parametrize(("arch", "backend"), [("llama", "torch"), ("qwen3", "torch"), ("llama", "vllm")])
def test_tp2_matches_single_rank(arch, backend, request, ray_session):
    model_dir = request.getfixturevalue(f"tiny_{arch}")
    settings = RunnerSettings(num_pages=64, backend=backend)
    single = ModelRunner(model_dir, settings)
    replica = Replica(model_dir, tensor_parallel_size=2, settings=settings)
    try:
        assert replica.info.tensor_parallel_size == 2 and replica.info.num_pages == 64
        tp = ReplicaAsRunner(replica)
        prompt = [random.Random(4).randrange(single.cfg.vocab_size) for _ in range(19)]
        assert greedy_generate(tp, prompt, 32, PageAllocator(64)) == greedy_generate(
            single, prompt, 32, PageAllocator(64)
        )

        seq_a, seq_b = Seq(list(prompt)), Seq(list(prompt))
        logits_slots = [(i, LOGITS) for i in range(len(prompt))]
        a = tp.execute(ForwardBatch([request_for(seq_a, PageAllocator(64, 1), 16, slots=logits_slots)]))[0]
        b = single.execute(ForwardBatch([request_for(seq_b, PageAllocator(64, 2), 16, slots=logits_slots)]))[0]
        la = np.stack([np.frombuffer(s.logits, np.float32) for s in a.slots])
        lb = np.stack([np.frombuffer(s.logits, np.float32) for s in b.slots])
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)

        bad = request_for(Seq([single.cfg.vocab_size + 5]), PageAllocator(64), 16)
        out = replica.execute(ForwardBatch([bad]))[0]
        assert "out of the vocabulary" in out.error
        assert (
            greedy_generate(tp, prompt, 4, PageAllocator(64))
            == greedy_generate(single, prompt, 32, PageAllocator(64))[:4]
        )
    finally:
        replica.shutdown()
