"""Losing the machine that runs Pie's control plane, as a head machine is lost: a third raylet joins, `pie start`'s
controller is started from it (so the controller, launcher, market, user directory and response store are placed
there, beside it) and it holds one of three bus shards; the model's replica and the running inferlets are on the
other nodes. The node is removed, its raylet and every process on it killed, the shard's journal with them.

Ray restarts every control-plane part on a live node with the state it keeps in the GCS; the restarted controller
makes the lost bus shard again there. Running inferlets go on: one waiting half way through a generation finishes
with the same tokens, one connected to the lost shard reaches its replacement through its host's relay, and the
first pull on a topic whose messages were lost with the node fails saying so. Programs, snapshots and wallets
survive, and new launches find the bus shard at its new address."""

from __future__ import annotations

import contextlib
import json
import time
import zlib

import pytest
import ray
from pie_cluster.bus import BusStats, find_bus
from pie_cluster.bus.queued_topics import SHRINK_S
from pie_cluster.config import AuthConfig, BusConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.controller import LAUNCHER
from pie_cluster.control.lifecycle import CONTROLLER, start_controller
from pie_cluster.control.status_records import Unanswered
from pie_cluster.market.actor import MARKET_NAME
from pie_cluster.stores.directory import DIRECTORY
from pie_cluster.stores.responses import RESPONSES
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.util.state import list_actors
from support.halves import wait_for_message
from support.launching import SAVES_AND_WAITS, launch, run_to_end, upload
from support.pie_procs import own_node

SHARDS = 3
USER = "alice"  # the launcher's tests' user: auth is off


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


@ray.remote(num_cpus=0)
def start_there(config: PieConfig):
    """`pie start` run on the node this task is pinned to."""
    start_controller(config, detached=True)


def topic_on(shard: int, prefix: str) -> str:
    return next(t for i in range(10_000) if zlib.crc32(f"{USER}\0{(t := f'{prefix}-{i}')}".encode()) % SHARDS == shard)


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def node_of(address: str, name: str) -> str:
    (actor,) = list_actors(address, filters=[("name", "=", name), ("state", "=", "ALIVE")])
    return actor["node_id"]


def tell(launcher, instance: str) -> None:
    host = ray.get(launcher.locate.remote(USER, instance)).host
    ray.get(host.send.remote(USER, instance, "message", "go on"))


def returned(launcher, instance: str):
    last = run_to_end(launcher, instance, USER)[-1]
    assert last[1] == "return", last
    return last[2]


@pytest.mark.slow
def test_the_control_plane_s_machine_is_lost_and_the_cluster_serves_on(ray_cluster, ray_session):
    survivors = alive_nodes()
    # the control plane and a bus shard; no replica fits there
    doomed_node = ray_cluster.add_node(num_cpus=0, **own_node())
    ray_cluster.wait_for_nodes()
    (doomed,) = alive_nodes() - survivors
    config = PieConfig(
        auth=AuthConfig(enabled=False),
        model=[ModelConfigEntry(pages=128, cpus_per_rank=1)],
        bus=BusConfig(shards=SHARDS),
        supervision=SupervisionConfig(probe_every_s=0.5, probe_deadline_s=3.0),
    )
    removed = False
    try:
        there = NodeAffinitySchedulingStrategy(doomed, soft=False)
        ray.get(start_there.options(scheduling_strategy=there).remote(config))
        parts = (CONTROLLER, LAUNCHER, MARKET_NAME, DIRECTORY, RESPONSES)
        assert {name: node_of(ray_cluster.address, name) for name in parts} == dict.fromkeys(parts, doomed)
        controller, launcher = ray.get_actor(CONTROLLER), ray.get_actor(LAUNCHER)
        (shard,) = [i for i, node in enumerate(ray.get(controller.status.remote()).bus_shards) if node == doomed]
        topics = {"lost": topic_on(shard, "lost"), "live": topic_on(shard, "live")}
        near, far = sorted(survivors)

        generate = upload(launcher, SAVES_AND_WAITS)
        expected = returned(launcher, launch(launcher, generate))
        assert returned(launcher, launch(launcher, upload(launcher, FILL), topics)) == "filled"
        waiting = launch(launcher, generate, {"save": True}, node_id=near)
        connected = launch(launcher, upload(launcher, CONNECTED), topics, node_id=far)
        wait_for_message(launcher, waiting)
        wait_for_message(launcher, connected)
        time.sleep(2 * SHRINK_S)  # "live" held a message a moment ago: past this, only "lost" is recorded so
        market = ray.get(controller.status.remote()).market
        assert market.wallets == 2, market

        lost_at = time.monotonic()
        ray_cluster.remove_node(doomed_node)  # the raylet and every process on it
        removed = True
        while True:
            try:
                status = ray.get(controller.status.remote(), timeout=5)
                if doomed not in status.bus_shards and not isinstance(status.launcher, Unanswered):
                    break
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                pass
            assert time.monotonic() - lost_at < 120, "the control plane did not come back"
            time.sleep(0.2)
        print(f"controller and bus shard {shard} serving again {time.monotonic() - lost_at:.1f} s after the loss")
        assert all(node_of(ray_cluster.address, name) in survivors for name in parts)

        tell(launcher, waiting)
        assert returned(launcher, waiting) == expected  # its wallet and contexts outlived the market's node
        tell(launcher, connected)
        round_trip, lost, after = json.loads(returned(launcher, connected))
        print(f"both running inferlets finished {time.monotonic() - lost_at:.1f} s after the loss")
        assert round_trip == "before" and after == "after"
        assert "may have been lost" in lost and "was lost" in lost, lost

        assert returned(launcher, launch(launcher, generate, {"open": True})) == expected  # the snapshot
        fresh = upload(launcher, FRESH)
        for node in (near, far):  # one host reaches the new shard on its node, the other through a relay
            assert returned(launcher, launch(launcher, fresh, topics, node_id=node)) == "fresh"
        assert {n.id for n in ray.get(launcher.list.remote(USER))} >= {waiting, connected}
        status = ray.get(controller.status.remote())
        assert status.market.wallets == 0 and status.market.balanced, status.market
        assert find_bus().stats(USER) == BusStats()
    finally:  # the session's later tests expect its two nodes and no controller
        with contextlib.suppress(ValueError):
            controller = ray.get_actor(CONTROLLER)
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
        if not removed:
            ray_cluster.remove_node(doomed_node)
