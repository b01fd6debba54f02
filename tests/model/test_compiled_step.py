"""Compiled decode steps (``RunnerSettings.compile``) against the eager runner: same greedy tokens, logits within 1e-4
(float32), on both backends and both tiny models; batches a graph must not take still run eager, and right.

Two sizes only (1 and 4): compiling a graph takes seconds on a 2-core CPU. Three sequences pad to 4. Steps run under
the "fail_on_recompile" stance: the runner's start-up must have compiled every graph they need."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch, Slot
from support.paged import LOGITS, PageAllocator, Seq, request_for

PAGES, SIZES = 96, (1, 4)


class Spy:
    """Counts the steps the compiled path took."""

    def __init__(self, compiled):
        self.compiled, self.steps = compiled, 0

    def accepts(self, batch: ForwardBatch) -> bool:
        return self.compiled.accepts(batch)

    def __call__(self, plan):
        self.steps += 1
        return self.compiled(plan)


@pytest.fixture(scope="module", params=["llama-torch", "qwen3-torch", "llama-vllm", "qwen3-vllm"])
def runners(request) -> tuple[ModelRunner, ModelRunner]:
    """(compiled, eager) runners of one model on one backend."""
    arch, backend = request.param.split("-")
    model = request.getfixturevalue(f"tiny_{arch}")
    compiled = ModelRunner(model, RunnerSettings(num_pages=PAGES, backend=backend, compile="on", compile_sizes=SIZES))
    compiled.compiled = Spy(compiled.compiled)
    return compiled, ModelRunner(model, RunnerSettings(num_pages=PAGES, backend=backend))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def decode(runner: ModelRunner, prompts: list[list[int]], steps: int, hidden: int = 0) -> tuple[list, list]:
    """Prefill (eager: several rows per request), then ``steps`` greedy decode steps; every sequence's tokens and every
    step's logits. ``hidden``: the first sequence's first tokens are hidden from it by a custom attention mask."""
    seqs, alloc = [Seq(list(p)) for p in prompts], PageAllocator(PAGES, 1)
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


def assert_same(compiled: tuple[list, list], eager: tuple[list, list]) -> None:
    assert compiled[0] == eager[0]
    for a, b in zip(compiled[1], eager[1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_decode_steps_match_eager(runners, batch):
    """Sizes 1 and 4 exactly, and 3 padded to 4 (the padding row writes no KV: later steps would see it)."""
    compiled, eager = runners
    before = compiled.compiled.steps
    ps = prompts(batch, seed=batch)
    assert_same(decode(compiled, ps, steps=12), decode(eager, ps, steps=12))
    assert compiled.compiled.steps - before == 12


@pytest.mark.parametrize(("batch", "hidden"), [(5, 0), (2, 3)], ids=["over-the-largest-size", "custom-mask"])
def test_steps_a_graph_cannot_take_run_eager(runners, batch, hidden):
    compiled, eager = runners
    before = compiled.compiled.steps
    ps = prompts(batch, seed=10 + batch)
    assert_same(decode(compiled, ps, steps=4, hidden=hidden), decode(eager, ps, steps=4, hidden=hidden))
    assert compiled.compiled.steps == before


def test_unknown_compile_mode_is_refused():
    with pytest.raises(ValueError, match="compile mode"):
        RunnerSettings(compile="always")
