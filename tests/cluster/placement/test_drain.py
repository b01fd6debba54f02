"""``pie drain``: a node closed to launches lets its running instances finish, ends those that outlive the timeout
with an error saying so, then stops its inferlet host for good; the rest of the cluster takes the launches."""

from __future__ import annotations

import json
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.control.status_records import DrainedNode
from pie_cluster.hosts.driver_events import poll
from support.launching import launch, run_to_end, upload

WAITS = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    ctx = Context(Model.load("default"))
    ctx.user("drain me").cue()
    first = await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
    session.send("started")
    await session.receive()
    return first
"""


@pytest.fixture(scope="module")
def cluster(ray_session):
    supervision = SupervisionConfig(probe_every_s=0.5, probe_deadline_s=3.0, misses=2)
    config = PieConfig(
        auth=AuthConfig(enabled=False), model=[ModelConfigEntry(pages=128, cpus_per_rank=1)], supervision=supervision
    )
    controller = start_controller(config, detached=False)
    yield controller
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def started(launcher, instance: str) -> None:
    since, deadline = 0, time.monotonic() + 120
    while time.monotonic() < deadline:
        got = poll(launcher, "alice", instance, since, 2.0)
        if any(e[1] == "message" for e in got.events):
            return
        assert not got.done, got.events
        since = got.next_index
    raise AssertionError(f"{instance} did not start")


def tell(launcher, instance: str) -> None:
    host = ray.get(launcher.locate.remote("alice", instance)).host
    ray.get(host.send.remote("alice", instance, "message", "finish"))


def test_draining_a_node_lets_its_instances_finish_ends_the_rest_and_stops_its_host(cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, WAITS)
    node, other = sorted(ray.get(cluster.nodes.remote()))
    finishes, stays = (launch(launcher, program, node_id=node) for _ in range(2))
    for instance in (finishes, stays):
        started(launcher, instance)

    draining = cluster.drain.remote(node, 4.0)
    time.sleep(1.0)
    with pytest.raises(RuntimeError, match="takes no launches: it was drained"):
        ray.get(launcher.launch.remote("alice", {"program": program, "node_id": node}))
    elsewhere = launch(launcher, program)  # an unpinned launch goes to the node that is not draining
    tell(launcher, finishes)
    report = ray.get(draining)

    assert (report.node, report.finished, report.ended) == (node, 1, 1), report
    assert run_to_end(launcher, finishes)[-1][1] == "return"
    ending = run_to_end(launcher, stays)[-1]
    assert ending[1] == "error" and f"node {node} was drained" in ending[2], ending
    started(launcher, elsewhere)
    assert ray.get(launcher.locate.remote("alice", elsewhere)).host is not None
    tell(launcher, elsewhere)
    assert json.loads(run_to_end(launcher, elsewhere)[-1][2])

    time.sleep(2.0)  # several node-watch rounds: the drained node gets no host again
    status = ray.get(cluster.status.remote())
    assert [n.node for n in status.nodes] == [other]
    assert status.drained == [DrainedNode(node, alive=True)]
    replica_nodes = [r.node for r in status.replicas]
    assert report.replicas == (["default #0"] if replica_nodes == [node] else [])
    with pytest.raises(ValueError, match="the last with an inferlet host"):
        ray.get(cluster.drain.remote(other, 1.0))
