"""A node that joins after the cluster started gets an inferlet host: ``pie status`` lists it serving, and a launch
pinned to it runs there (reaching the model on another node). The node is removed at the end, and is then shown
lost like any other."""

from __future__ import annotations

import json
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.control.status_records import NodeStatus
from support.launching import launch, run_to_end, upload
from support.pie_procs import own_node

GREEDY = """
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("hello from the new node")
        return await ctx.generate(Sampler.argmax(), max_tokens=3, stop=[]).collect_tokens()
"""


def host_of(controller, node: str) -> NodeStatus | None:
    return {n.node: n for n in ray.get(controller.status.remote()).nodes}.get(node)


@pytest.mark.slow
def test_a_node_that_joins_later_gets_a_host_and_runs_launches(ray_cluster, ray_session):
    config = PieConfig(
        auth=AuthConfig(enabled=False),
        model=[ModelConfigEntry(pages=64)],
        supervision=SupervisionConfig(probe_every_s=1.0),
    )
    controller = start_controller(config, detached=False)
    joined = None
    try:
        launcher = ray.get_actor("pie-launcher")
        before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        joined = ray_cluster.add_node(num_cpus=1, **own_node())
        ray_cluster.wait_for_nodes()
        (node,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
        began = time.monotonic()
        for _ in range(240):
            row = host_of(controller, node)
            if row is not None and row.host == "serving":
                break
            time.sleep(0.5)
        print(f"node joined -> its host serving in {time.monotonic() - began:.1f} s")
        assert row is not None and row.host == "serving", row
        last = run_to_end(launcher, launch(launcher, upload(launcher, GREEDY), node_id=node))[-1]
        assert last[1] == "return" and len(json.loads(last[2])) == 3, last
    finally:
        if joined is not None:
            ray_cluster.remove_node(joined)
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
