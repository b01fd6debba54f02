"""Losing the node of a bus shard: a third raylet joins, holds one of three shards (and an inferlet host, no replica),
and is removed, its raylet and every process on it killed, the shard's journal with them. The controller makes the
shard again on a live node; sandboxed inferlets that were connected to it reach the replacement through their
host's relay without being restarted, the first pull on a topic whose messages were lost with the node fails
saying so, and new launches find the shard at its new address."""

from __future__ import annotations

import json
import time
import zlib

import pytest
import ray
from launching import launch, run_to_end, upload
from pie_cluster.bus import find_bus
from pie_cluster.bus.queued_topics import SHRINK_S
from pie_cluster.config import AuthConfig, BusConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.controller import start_controller
from pie_cluster.events import poll

SHARDS = 3

FILL = """
from inferlet import messaging

async def main(input):
    for i in range(3):
        messaging.push(input["lost"], f"queued {i}")
    return "filled"  # ending waits until the shard has journaled every push
"""

CONNECTED = """
import json
from inferlet import messaging, session

async def main(input):
    messaging.push(input["live"], "before")
    before = await messaging.pull(input["live"])  # a round trip through the doomed shard
    session.send("connected")
    await session.receive()  # the node is gone and the shard replaced
    try:
        lost = "pulled " + await messaging.pull(input["lost"])
    except messaging.BusError as e:
        lost = str(e)
    messaging.push(input["live"], "after")  # through the same socket, reconnected to the replacement
    return json.dumps([before, lost, await messaging.pull(input["live"])])
"""

FRESH = """
from inferlet import messaging

async def main(input):
    messaging.push(input["live"], "fresh")
    return await messaging.pull(input["live"])
"""


def topic_on(shard: int, user: str, prefix: str) -> str:
    return next(t for i in range(10_000) if zlib.crc32(f"{user}\0{(t := f'{prefix}-{i}')}".encode()) % SHARDS == shard)


def shard_nodes(controller) -> list[str]:
    return ray.get(controller.status.remote())["bus_shards"]


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def wait_for_message(launcher, instance: str) -> None:
    since, deadline = 0, time.monotonic() + 120
    while time.monotonic() < deadline:
        got = poll(launcher, "ann", instance, since, 2.0)
        if any(e[1] == "message" for e in got["events"]):
            return
        assert not got["done"], got["events"]
        since = got["next"]
    raise AssertionError(f"{instance} did not connect")


@pytest.mark.slow
def test_a_shard_whose_node_is_lost_is_replaced_and_says_what_was_lost(ray_cluster, ray_session):
    before = alive_nodes()
    doomed_node = ray_cluster.add_node(num_cpus=0)  # a shard and a host; no replica fits there
    ray_cluster.wait_for_nodes()
    (doomed,) = alive_nodes() - before
    config = PieConfig(
        auth=AuthConfig(enabled=False),
        model=[ModelConfigEntry(pages=64, cpus_per_rank=1)],
        bus=BusConfig(shards=SHARDS),
        supervision=SupervisionConfig(probe_every_s=0.5, probe_deadline_s=3.0),
    )
    controller = start_controller(config, detached=False)
    try:
        launcher = ray.get_actor("pie-launcher")
        (shard,) = [i for i, node in enumerate(shard_nodes(controller)) if node == doomed]
        topics = {"lost": topic_on(shard, "ann", "lost"), "live": topic_on(shard, "ann", "live")}
        head, second = sorted(before)  # the connected inferlet stays on a node that survives
        filled = run_to_end(launcher, launch(launcher, upload(launcher, FILL, "ann"), topics, "ann"), "ann")
        assert filled[-1][1:] == ["return", "filled"], filled
        connected = launch(launcher, upload(launcher, CONNECTED, "ann"), topics, "ann", node_id=head)
        wait_for_message(launcher, connected)
        time.sleep(2 * SHRINK_S)  # "live" held a message a moment ago: past this, only "lost" is recorded as holding

        lost_at = time.monotonic()
        ray_cluster.remove_node(doomed_node)  # the raylet and every process on it: the shard, its journal's disk
        deadline = time.monotonic() + 120
        while (moved := shard_nodes(controller)[shard]) == doomed:
            assert time.monotonic() < deadline, "the shard was not replaced"
            time.sleep(0.2)
        print(f"bus shard {shard} replaced on another node {time.monotonic() - lost_at:.1f} s after its node's loss")
        assert moved in before

        host = ray.get(launcher.locate.remote("ann", connected))["host"]
        ray.get(host.send.remote("ann", connected, "message", "go on"))
        events = run_to_end(launcher, connected, "ann")
        assert events[-1][1] == "return", events[-1]
        round_trip, lost, after = json.loads(events[-1][2])
        print(f"the connected inferlet went on {time.monotonic() - lost_at:.1f} s after the node's loss")
        assert round_trip == "before" and after == "after"
        assert "may have been lost" in lost and "was lost" in lost, lost

        fresh = upload(launcher, FRESH, "ann")
        for node in (head, second):  # one host reaches the new shard on its node, the other through a relay
            events = run_to_end(launcher, launch(launcher, fresh, topics, "ann", node_id=node), "ann")
            assert events[-1][1:] == ["return", "fresh"], events[-1]
        assert find_bus().stats("ann") == {"sessions": 0, "topics": 0, "queued": 0, "waiters": 0, "subscriptions": 0}
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
