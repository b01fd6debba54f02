"""A rank's torch threads (``rank_threads.py``): with ``cpus_per_rank`` automatic, a CPU rank runs as many threads as
its CPUs and cores allow, but one for a model whose layers are too small to split; a set ``cpus_per_rank`` is kept."""

from __future__ import annotations

import json

import pytest
from pie_workers.config import ModelConfig
from pie_workers.rank_threads import MIN_LAYER_WEIGHTS, layer_weights, rank_threads, usable_cores


def shaped(tiny_llama, hidden: int, heads: int, kv_heads: int, intermediate: int) -> ModelConfig:
    """The tiny Llama's config with another shape."""
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads)
    cfg.update(intermediate_size=intermediate)
    return ModelConfig.from_dict(cfg)


def test_a_layers_weights_are_its_attention_and_mlp_matrices_split_over_the_ranks(tiny_llama):
    cfg = ModelConfig.from_dir(tiny_llama)  # hidden 128, 4 heads and 2 kv heads of 32, intermediate 256
    assert layer_weights(cfg, 1) == 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256
    assert layer_weights(cfg, 2) == layer_weights(cfg, 1) // 2


def test_the_tiny_model_runs_one_thread_and_a_bigger_one_all_it_may(tiny_llama):
    tiny = ModelConfig.from_dir(tiny_llama)
    bigger = shaped(tiny_llama, hidden=1024, heads=16, kv_heads=8, intermediate=2816)
    assert layer_weights(tiny, 1) < MIN_LAYER_WEIGHTS <= layer_weights(bigger, 1)
    assert rank_threads(4, tiny, 1) == 1
    assert rank_threads(4, bigger, 1) == min(4, usable_cores())
    assert rank_threads(1, bigger, 1) == 1
    # split over enough ranks, a layer is small again
    medium = shaped(tiny_llama, hidden=256, heads=4, kv_heads=2, intermediate=704)
    assert rank_threads(2, medium, 1) == min(2, usable_cores())
    assert rank_threads(2, medium, 4) == 1


@pytest.mark.parametrize("fit_threads", [True, False], ids=["automatic", "set"])
def test_a_replica_reports_the_threads_its_rank_runs(ray_session, tiny_llama, fit_threads):
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings

    replica = Replica(tiny_llama, 1, RunnerSettings(num_pages=16), cpus_per_rank=2, fit_threads=fit_threads)
    try:
        assert replica.info.threads == (1 if fit_threads else min(2, usable_cores()))
    finally:
        replica.shutdown()
