"""Scale-down without recompute: when the replica scaler removes a replica (``control.scaling``), the contexts of the
inferlets still running on it move to the remaining replica with their KV pages (``control.handover``), each
inferlet's link claims its context there (``inferlet._failover``: ``transferred``), and the inferlet goes on with the
greedy tokens of a run that never moved. The replica and its placement group are gone afterwards.

Why the setup is as it is: the policy counts contexts, so load must first bring a second replica and then leave while
an inferlet still holds a context on it. An inferlet reaches its own node's replica (``control.services``), so the
second replica is made to land on the other node (the first replica's node is filled with a CPU-holding actor), and
the inferlet that must move is launched on that node once the second replica serves. Three holders on the first
replica bring the load (4 contexts at ``target_load = 2``); aborting them drops it to 1, and the scaler removes
replica 1 while the mover waits for a message between two generations."""

from __future__ import annotations

import json
import time

import pytest
import ray
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.hosts.driver_events import poll
from ray._private.state import available_resources_per_node
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.util.state import list_actors
from support.launching import HOLD, autoscaled_config, launch, replica_groups, run_to_end, upload

# Generates, (with ``{"wait": true}``) says so and waits for a message, then generates more; returns its tokens and
# what its link did: moves to another replica, contexts taken up there with their KV.
MOVER = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user("a story that changes replicas").cue()
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=6, stop=[]).collect_tokens()
        if input.get("wait"):
            session.send("generated")
            await session.receive()
        tokens += await ctx.generate(Sampler.argmax(), max_tokens=10, stop=[]).collect_tokens()
    return {"tokens": tokens, "moves": model.link.moves, "transferred": model.link.transferred}
"""


@ray.remote
class NodeFiller:
    """Holds CPUs of one node so that no further replica bundle fits there."""

    def ready(self) -> bool:
        return True


def until(what: str, check, timeout_s: float = 180):
    """``check()``'s first truthy answer, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.3)
    raise AssertionError(f"not {what} within {timeout_s} s")


def serving(controller, replicas: int):
    status = ray.get(controller.status.remote())
    (scale,) = status.scaling
    rows = status.replicas
    whole = scale.current == len(rows) == replicas  # (the rows and the count are read a moment apart)
    return (scale, rows) if whole and all(r.state == "serving" for r in rows) else None


def engine_stats(controller) -> list:
    """Each serving replica's ``EngineStats``, in replica order (read from the replicas' leaders)."""
    leaders = ray.get(controller.__ray_call__.remote(lambda c: [r.leader for r in c.replicas["default"]]))
    return ray.get([leader.engine_stats.remote() for leader in leaders])


def reaches_replica_1(controller, node: str) -> bool:
    """Whether an inferlet launched on ``node`` now reaches replica 1 (published to the node's host: the scaler
    counts a replica before it publishes it)."""
    host, address = ray.get(
        controller.__ray_call__.remote(lambda c: (c.hosts[node], c.replicas["default"][1].addresses["ipc"]))
    )
    return ray.get(host.__ray_call__.remote(lambda h: h.services.endpoints["default"].address)) == address


def said_something(launcher, instance: str) -> bool:
    events = poll(launcher, "alice", instance, 0, 1.0).events
    assert not any(e[1] in ("return", "error") for e in events), events
    return any(e[1] == "message" for e in events)


def tell(launcher, instance: str) -> None:
    host = ray.get(launcher.locate.remote("alice", instance)).host
    ray.get(host.send.remote("alice", instance, "message", "go on"))


def returned(launcher, instance: str) -> dict:
    last = run_to_end(launcher, instance)[-1]
    assert last[1] == "return", last
    return json.loads(last[2])


@pytest.mark.slow
def test_scaling_down_hands_a_running_inferlets_context_over_with_its_kv(ray_cluster, ray_session):
    config = autoscaled_config()
    groups_before = replica_groups()
    controller = start_controller(config, detached=False)
    filler = None
    try:
        launcher = ray.get_actor("pie-launcher")
        _, (first,) = until("one replica serving", lambda: serving(controller, 1))
        free = available_resources_per_node()[first.node].get("CPU", 0)  # what the session's other work left
        filler = NodeFiller.options(
            num_cpus=free, scheduling_strategy=NodeAffinitySchedulingStrategy(first.node, False)
        ).remote()
        ray.get(filler.ready.remote(), timeout=60)  # replica 1's bundle now fits only the other node

        holders = [launch(launcher, upload(launcher, HOLD)) for _ in range(3)]  # 3 contexts on replica 0
        _, rows = until("two replicas serving", lambda: serving(controller, 2))
        assert rows[1].node != first.node
        until("replica 1 published to its node's host", lambda: reaches_replica_1(controller, rows[1].node), 30)
        mover = launch(launcher, upload(launcher, MOVER), {"wait": True}, node_id=rows[1].node)
        until("the mover half way", lambda: said_something(launcher, mover))
        before = engine_stats(controller)
        assert [s.contexts for s in before] == [3, 1], "the holders' contexts on replica 0, the mover's on replica 1"

        for instance in holders:  # load 1: one replica wanted
            ray.get(launcher.abort.remote("alice", instance))
        adopted = before[0].moved_in + 1
        until("the mover's context adopted by replica 0", lambda: engine_stats(controller)[0].moved_in == adopted)
        tell(launcher, mover)  # the replica that left answers its next call with where its context went
        moved = returned(launcher, mover)

        scale, _ = until("one replica serving", lambda: serving(controller, 1))
        (after,) = engine_stats(controller)
        assert scale.target == 1, scale
        assert (moved["moves"], moved["transferred"]) == (1, 1), moved  # claimed with its KV, not recomputed
        assert (after.moved_in - before[0].moved_in, after.claimed - before[0].claimed) == (1, 1), after
        until("replica 1's placement group removed", lambda: replica_groups() == groups_before + 1, 60)
        alive = {a["name"] or "" for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)}
        assert not [name for name in alive if name.startswith("pie-replica/default/1/")], alive

        unmoved = returned(launcher, launch(launcher, upload(launcher, MOVER)))
        assert (unmoved["moves"], unmoved["transferred"]) == (0, 0), unmoved
        assert moved["tokens"] == unmoved["tokens"] and len(moved["tokens"]) == 16, (moved, unmoved)
    finally:
        if filler is not None:
            ray.kill(filler)
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
    assert replica_groups() == groups_before
