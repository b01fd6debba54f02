"""Test helper: greedy decode through a runner whose decode steps may take a graph path (``compiled_step``,
``cuda_graph_step``), and a spy that counts the steps that did."""

from __future__ import annotations

import random

import numpy as np
import torch
from pie_workers.runner import ModelRunner
from pie_workers.wire.batch import ForwardBatch, Slot
from support.paged import LOGITS, PageAllocator, Seq, request_for


class Spy:
    """Counts the steps the graph path took."""

    def __init__(self, graphs):
        self.graphs, self.steps = graphs, 0

    def accepts(self, batch: ForwardBatch) -> bool:
        return self.graphs.accepts(batch)

    def __call__(self, plan):
        self.steps += 1
        return self.graphs(plan)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def decode(
    runner: ModelRunner, prompts: list[list[int]], steps: int, hidden: int = 0, pages: int = 96
) -> tuple[list, list]:
    """Prefill (eager: several rows per request), then ``steps`` greedy decode steps; every sequence's tokens and every
    step's logits. ``hidden``: the first sequence's first tokens are hidden from it by a custom attention mask."""
    seqs, alloc = [Seq(list(p)) for p in prompts], PageAllocator(pages, 1)
    logits = []
    for _ in range(steps + 1):
        reqs = []
        for k, seq in enumerate(seqs):
            last = len(seq.pending()) - 1
            masks = None
            if hidden and k == 0:
                seen = [seq.kv_len + i + 1 for i in range(last + 1)]  # slots each row attends causally
                masks = [[hidden, n - hidden] if n > hidden else [0, n] for n in seen]
            reqs.append(
                request_for(seq, alloc, 16, slots=[(last, Slot.argmax()), (last, LOGITS)], attention_masks=masks)
            )
        with torch.compiler.set_stance("fail_on_recompile"):  # start-up compiled every graph a step needs
            outs = runner.execute(ForwardBatch(reqs))
        for seq, req, out in zip(seqs, reqs, outs, strict=True):
            assert out.error is None, out.error
            seq.kv_len += len(req.token_ids)
            seq.tokens.append(out.slots[0].token)
        logits.append(np.stack([np.frombuffer(o.slots[1].logits, np.float32) for o in outs]))
    return [s.tokens for s in seqs], logits


def assert_same(graphs: tuple[list, list], eager: tuple[list, list], atol: float = 1e-4) -> None:
    assert graphs[0] == eager[0]
    for a, b in zip(graphs[1], eager[1], strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)
