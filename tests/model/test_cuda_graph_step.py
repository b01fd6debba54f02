"""CUDA-graph decode steps (``cuda_graph_step``) without a GPU: the half that is not the capture. A graph replays
whatever its captured plan read, so what decides its tokens is the inputs: the step's rows copied into the static
buffers, padded to a captured size whose padded rows write only the pool's scratch page and read one slot of it,
rows a larger step left behind rewritten, the attention kernel taking any context length from the buffers.

Here each size's "replay" runs the model over that same captured plan (the buffers' views), eagerly, with the Triton
kernel under its interpreter (in a child process, as ``test_triton_attention`` explains), against the eager runner
over the same pool. The capture itself, and the steps a graph cannot take (which run eager, by the same
``plain_decode`` as ``torch.compile``'s steps), run where CUDA is: ``test_compiled_step``'s ``cuda`` cases."""

from __future__ import annotations

import json
import sys

import pytest
from support.triton_child import interpreted_run

SIZES, STEPS = (1, 4), 4
PAGES = 16  # the pages handed out: page 0 among the first three, so that a padded row writing there would show


class EagerReplay:
    """Stands in for one size's ``torch.cuda.CUDAGraph``: replaying reruns the captured plan into the same logits."""

    def __init__(self, graphs, size: int):
        self.graphs, self.plan = graphs, graphs.inputs.plan(size, graphs.positions_held - 1)
        self.logits = graphs.model(self.plan, graphs.kv, None)

    def replay(self) -> None:
        self.logits.copy_(self.graphs.model(self.plan, self.graphs.kv, None))


def decode_both_ways(model_dir: str) -> dict:
    """Greedy tokens and logits through the graph path's buffers and through the eager runner, for batches at a
    captured size (1, 4) and padded to one (3, after 4: its padded row is one the larger step used); and how many
    steps the graph path took."""
    import torch
    from pie_workers.cuda_graph_step import CudaGraphDecode, _Graph
    from pie_workers.kv_pool import PoolShape
    from pie_workers.runner import ModelRunner, RunnerSettings
    from pie_workers.triton_kv_pool import TritonKVPool
    from support.decode_steps import Spy, decode, prompts

    settings = RunnerSettings(num_pages=96, device="cpu", backend="torch", compile="off")
    graph_runner, eager = ModelRunner(model_dir, settings), ModelRunner(model_dir, settings)
    cfg = graph_runner.cfg
    for runner in (graph_runner, eager):
        runner.kv = TritonKVPool(PoolShape(cfg, 96, 16, cfg.num_kv_heads, runner.dtype, runner.device))
    graphs = CudaGraphDecode(graph_runner.model, graph_runner.kv, SIZES)
    with torch.inference_mode():
        for size in graphs.sizes:
            replay = EagerReplay(graphs, size)
            graphs.graphs[size] = _Graph(replay, replay.logits)
    graph_runner.compiled = spy = Spy(graphs)
    result = {}
    for batch in (1, 4, 3):
        ps = prompts(batch, seed=batch)
        before = spy.steps
        ours, theirs = decode(graph_runner, ps, STEPS, pages=PAGES), decode(eager, ps, STEPS, pages=PAGES)
        result[str(batch)] = {
            "tokens": ours[0] == theirs[0],
            "logit error": max(float(abs(a - b).max()) for a, b in zip(ours[1], theirs[1], strict=True)),
            "graph steps": spy.steps - before,
        }
    return result


@pytest.fixture(scope="module")
def interpreted(tiny_llama) -> dict:
    return interpreted_run(__file__, str(tiny_llama))


@pytest.mark.parametrize("batch", [1, 4, 3], ids=["size 1", "size 4", "3 padded to 4"])
def test_decode_steps_through_the_buffers_match_eager(interpreted, batch):
    """Padded to a captured size: the padded row's KV goes to the scratch page, where no request reads."""
    run = interpreted[str(batch)]
    assert run["tokens"] and run["logit error"] <= 1e-4
    assert run["graph steps"] == STEPS


if __name__ == "__main__":  # the child of ``interpreted``: TRITON_INTERPRET=1 is set before triton is imported
    print(json.dumps(decode_both_ways(sys.argv[1])))
