"""Losing a worker node: a third raylet joins the session's cluster, serves a replica and an inferlet host, and is
removed (its raylet and every process on it killed). Its replica and host are reported dead, the instance running
there fails with an error event, launches avoid the node, and the rest of the cluster keeps serving."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.hosts.driver_events import poll
from pie_cluster.launch_request import LaunchRequest

PARKED = b"""
from inferlet import session

async def main(input):
    session.send("parked")
    return await session.receive()
"""

GREEDY = textwrap.dedent("""
    from inferlet import Context, Model, Sampler

    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("still serving?")
            return await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
""").encode()


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


@pytest.mark.slow
def test_a_lost_node_is_reported_and_the_rest_of_the_cluster_keeps_serving(ray_cluster, extra_node):
    before = alive_nodes()
    doomed_node = extra_node(num_cpus=2)
    (doomed,) = alive_nodes() - before
    model = ModelConfigEntry(pages=128, cpus_per_rank=1, replicas=3, placement="strict_spread")
    config = PieConfig(auth=AuthConfig(enabled=False), model=[model])
    controller = start_controller(config, detached=False)  # its control plane stays on this driver's node, the head
    try:
        launcher = ray.get_actor("pie-launcher")
        status = ray.get(controller.status.remote())
        assert sorted(r.node for r in status.replicas) == sorted(before | {doomed})
        program = ray.get(launcher.upload.remote("ann", "greedy.py", GREEDY)).program
        parked = ray.get(launcher.upload.remote("ann", "parked.py", PARKED)).program
        stranded = ray.get(launcher.launch.remote("ann", LaunchRequest(program=parked, node_id=doomed)))
        assert poll(launcher, "ann", stranded, 0, 60.0).events[0][1:] == ["message", "parked"]

        ray_cluster.remove_node(doomed_node)  # the raylet and every process on the node are killed
        for _ in range(120):
            status = ray.get(controller.status.remote())
            lost = {n.node: n for n in status.nodes}[doomed]
            if not lost.alive and lost.host != "serving":
                break
            time.sleep(0.5)
        assert not lost.alive and lost.host != "serving", lost
        last = poll(launcher, "ann", stranded, 0, 60.0).events[-1]
        assert last[1] == "error" and "died" in last[2], last  # its instance is reported failed
        states = {r.node: r.state for r in status.replicas}
        assert states[doomed] != "serving" and all(states[n] == "serving" for n in before), states

        for node in (*sorted(before), None, None, None):  # pinned to a live node, or placed by the launcher
            instance = ray.get(launcher.launch.remote("ann", LaunchRequest(program=program, node_id=node)))
            events = poll(launcher, "ann", instance, 0, 60.0)
            while not events.done:
                more = poll(launcher, "ann", instance, events.next_index, 60.0)
                events = dataclasses.replace(more, events=events.events + more.events)
            assert events.events[-1][1] == "return", events.events[-1]
            assert len(json.loads(events.events[-1][2])) == 4
        with pytest.raises(RuntimeError, match="is down"):
            ray.get(launcher.launch.remote("ann", LaunchRequest(program=program, node_id=doomed)))
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
