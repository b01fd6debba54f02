"""Decode steps through graphs (``RunnerSettings.compile``) against the eager runner: same greedy tokens, logits
within 1e-4 (float32). On this CPU, ``torch.compile``d steps on both backends and both tiny models; where CUDA is
(``gpu``), CUDA graphs of the torch backend (``cuda_graph_step``; their padding without a GPU:
``test_cuda_graph_step``). Batches a graph must not take still run eager, and right.

Two sizes only (1 and 4): compiling a graph takes seconds on a 2-core CPU. Three sequences pad to 4. Steps run under
the "fail_on_recompile" stance: the runner's start-up must have compiled every graph they need."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pie_workers.runner import ModelRunner, RunnerSettings
from support.decode_steps import Spy, assert_same, decode, prompts

PAGES, SIZES = 96, (1, 4)
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: no CUDA graphs")]
CASES = [
    "llama-torch", "qwen3-torch", "llama-vllm", "qwen3-vllm",
    pytest.param("llama-torch-cuda", marks=ON_GPU), pytest.param("qwen3-torch-cuda", marks=ON_GPU),
]  # fmt: skip


@pytest.fixture(scope="module", params=CASES)
def runners(request) -> tuple[ModelRunner, ModelRunner]:
    """(graphs, eager) runners of one model on one backend (on a GPU: in float32, which the tolerances are for)."""
    arch, backend, *cuda = request.param.split("-")
    model = request.getfixturevalue(f"tiny_{arch}")
    device = dict(device="cuda", dtype="float32") if cuda else dict(device="cpu")
    settings = RunnerSettings(num_pages=PAGES, backend=backend, compile_sizes=SIZES, **device)
    graphs = ModelRunner(model, dataclasses.replace(settings, compile="on"))
    graphs.compiled = Spy(graphs.compiled)
    return graphs, ModelRunner(model, dataclasses.replace(settings, compile="off"))


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
