"""Placing an actor on a node by preference, so that Ray may restart it on another where that node is lost.

Ray places a request for no resources on a random node whatever its strategy says: only a hard node affinity is
honoured then (seen here: actors with ``num_cpus=0`` and a soft affinity landed on either of two nodes at random).
So an actor that should prefer a node reserves one byte of memory, which makes its request one the strategy
applies to, and spills to another node where that one has no room now rather than wait for it.
"""

from __future__ import annotations

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

RESERVED_BYTES = 1


def preferring(node_id: str) -> dict:
    """Actor options: on ``node_id`` while it is alive and has room; elsewhere otherwise (a restart after its loss)."""
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=True, _spill_on_unavailable=True)
    return {"scheduling_strategy": strategy, "memory": RESERVED_BYTES}
