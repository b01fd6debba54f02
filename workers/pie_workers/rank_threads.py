"""How many torch threads a CPU rank runs with when its ``cpus_per_rank`` is automatic: the CPUs of its bundle and
the cores it may use, but one thread for a model too small to split.

A small model's decode step is a string of small matmuls: splitting each over threads costs more in fork and join
than it saves, and on a node whose other cores also run the inferlet hosts, the ingress and the market, a second
OpenMP thread waits on (or spins against) them. Measured on a 2-core node (vllm kernels, one decode step of
32-token prompts at batch 1 / 8 / 32, two threads against one, alone):

* the embedded tiny model (0.15 M weights per layer): 1.00x / 1.09x / 1.18x; with the other core half busy, 0.63x;
* hidden 256 (0.74 M per layer): 1.24x / 1.28x / 1.47x; hidden 512 (2.9 M): 2.0x; hidden 1,024 (11.8 M): 1.75x.

Served, the tiny model on one thread instead of two answered 32 concurrent OpenAI clients at 98 instead of 79
requests/s with 40% less CPU per request, and ran swarm agents (K = 8) in 0.65 instead of 0.85 s.
"""

from __future__ import annotations

import os

from pie_workers.config import ModelConfig

MIN_LAYER_WEIGHTS = 250_000  # a rank's share of one decoder layer's matmul weights below which one thread is best


def layer_weights(cfg: ModelConfig, tensor_parallel: int) -> int:
    """One rank's share of the weights one token's pass through a decoder layer multiplies by."""
    attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, k, v and o
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up and down
    return (attention + mlp) // tensor_parallel


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else the machine's count): a node may
    declare more Ray CPUs than it has, and OpenMP threads beyond the cores spin against each other."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rank_threads(cpus: int, cfg: ModelConfig, tensor_parallel: int) -> int:
    """Threads for a CPU rank with ``cpus`` CPUs of its own, automatic: never more than its cores, one for a small
    model."""
    if layer_weights(cfg, tensor_parallel) < MIN_LAYER_WEIGHTS:
        return 1
    return max(1, min(cpus, usable_cores()))
