"""The automatic ``cpus_per_rank`` (``cpu_share.py``): what the nodes spare, split among the ranks each node takes,
for a few node and replica layouts. Pure: no Ray."""

from __future__ import annotations

import pytest
from pie_cluster.config import ModelConfigEntry
from pie_cluster.control.cpu_share import ModelShape, NodeRoom, automatic_cpus_per_rank, places


def nodes(*cpus: float) -> list[NodeRoom]:
    return [NodeRoom(c) for c in cpus]


def test_unset_is_automatic_and_an_explicit_value_stays():
    assert ModelConfigEntry().cpus_per_rank is None
    assert ModelConfigEntry(cpus_per_rank=3).cpus_per_rank == 3


@pytest.mark.parametrize(
    ("cpus", "models", "share"),
    [
        ((2,), [ModelShape()], 2),  # `pie run` on a 2-core machine: both cores, not 1
        ((16,), [ModelShape(tensor_parallel=4)], 4),  # a tensor-parallel group shares its node
        ((4,), [ModelShape(replicas=2)], 2),  # two replicas on one node
        ((4, 4), [ModelShape(replicas=2, placement="strict_spread")], 4),  # a node each
        ((4, 4), [ModelShape(replicas=3)], 2),  # three replicas over two nodes: two share one
        ((8, 8), [ModelShape(replicas=2), ModelShape()], 4),  # configs/config.toml's two models
        ((4, 4, 1), [ModelShape()], 1),  # the smallest node decides (a bundle fits any node)
        ((0, 4), [ModelShape()], 4),  # a node with nothing to spare (a CPU-less head) takes no rank
        ((), [ModelShape()], 1),  # nothing known: the old default
        ((3,), [ModelShape(replicas=4)], 1),  # more ranks than CPUs: at least 1 each
    ],
)
def test_layouts(cpus, models, share):
    assert automatic_cpus_per_rank(nodes(*cpus), models) == share


def test_the_share_is_lowered_until_later_models_still_fit():
    """Two spread replicas would take 2 + 2 of two 4-CPU nodes, leaving no node room for a tp=2 group of 2 x 2."""
    models = [ModelShape(replicas=2), ModelShape(tensor_parallel=2)]
    assert not places(nodes(4, 4), models, 2)
    assert automatic_cpus_per_rank(nodes(4, 4), models) == 1


def test_explicit_models_take_their_cpus_first():
    models = [ModelShape(cpus_per_rank=3), ModelShape()]
    assert automatic_cpus_per_rank(nodes(4), models) == 1  # 3 set aside; the ranks-per-node share (2) would not fit
    assert automatic_cpus_per_rank(nodes(8), models) == 4  # floor(8 / 2 ranks), and 3 + 4 fits


def test_custom_resources_keep_a_model_to_the_nodes_that_declare_them():
    pinned = [NodeRoom(4), NodeRoom(4, {"gpu_box": 2})]
    models = [ModelShape(replicas=2, resources={"gpu_box": 1})]  # both replicas on the one node that declares it
    assert automatic_cpus_per_rank(pinned, models) == 2


def test_pack_fills_one_node_before_the_next():
    assert places(nodes(4, 4), [ModelShape(replicas=2, placement="pack"), ModelShape(tensor_parallel=2)], 2)
