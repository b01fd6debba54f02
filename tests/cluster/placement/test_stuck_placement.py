"""A replacement Ray cannot place never holds up another model's supervision: model "pinned" is kept (by a custom
resource) to a third node that is then removed, so its replacement waits for a bundle no node can take; meanwhile
the leader of model "default" is SIGKILLed, and it is replaced and serves while "pinned" is still restarting. A start
whose model Ray cannot place at all fails and leaves nothing running; one whose process dies says why Ray saw it
die."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.lifecycle import death_cause, start_controller
from pie_cluster.control.status_records import ClusterStatus, ReplicaStatus
from support.launching import launch, run_to_end, upload

GREEDY = """
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("who is still here?")
        return await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
"""


def rows(controller) -> tuple[ClusterStatus, dict[str, ReplicaStatus]]:
    status = ray.get(controller.status.remote())
    return status, {r.model: r for r in status.replicas}


@pytest.mark.slow
def test_a_replacement_that_cannot_be_placed_does_not_stop_another_models_replacement(ray_cluster, extra_node):
    before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    third = extra_node(num_cpus=1, resources={"pinned_node": 1})
    (pinned_node,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
    models = [  # "pinned" first, so it takes the third node's only CPU and "default" goes elsewhere
        ModelConfigEntry(name="pinned", pages=64, resources={"pinned_node": 1}),
        ModelConfigEntry(name="default", pages=64),
    ]
    # start_s bounds the stuck replacement's wait and also every replica's start: room for a machine that runs a
    # second test session beside this one (20 s was not)
    supervision = SupervisionConfig(probe_every_s=1.0, probe_deadline_s=3.0, start_s=60.0)
    config = PieConfig(auth=AuthConfig(enabled=False), model=models, supervision=supervision)
    controller = start_controller(config, detached=False)
    try:
        launcher = ray.get_actor("pie-launcher")
        program = upload(launcher, GREEDY)
        status, by_model = rows(controller)
        assert by_model["pinned"].node == pinned_node and by_model["default"].node != pinned_node, by_model

        ray_cluster.remove_node(third)  # "pinned"'s bundle now fits no node: its replacement waits and times out
        for _ in range(120):
            status, by_model = rows(controller)
            if by_model["pinned"].state == "restarting":
                break
            time.sleep(0.5)
        assert by_model["pinned"].state == "restarting", by_model

        killed = time.monotonic()
        os.kill(by_model["default"].pids[0], signal.SIGKILL)
        for _ in range(480):
            status, by_model = rows(controller)
            if status.replica_restarts >= 1 and by_model["default"].state == "serving":
                break
            time.sleep(0.25)
        print(f"leader SIGKILL beside a stuck placement -> serving again in {time.monotonic() - killed:.1f} s")
        assert by_model["default"].state == "serving" and status.replica_restarts == 1, status
        assert by_model["pinned"].state == "restarting", by_model  # still waiting for a node with its resource
        last = run_to_end(launcher, launch(launcher, program))[-1]
        assert last[1] == "return" and len(json.loads(last[2])) == 4, last
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)


def test_a_start_whose_model_cannot_be_placed_fails_naming_it_and_leaves_nothing_running(ray_session):
    """The launcher, bus, market and stores start while the models load (detached, as `pie start` makes them): a
    model that never gets its bundle takes them down with the failed start, so nothing of it outlives the error
    or is handed by name to the next start."""
    before = set(ray.util.list_named_actors())
    models = [ModelConfigEntry(name="nowhere", pages=64, resources={"no_such_node": 1})]
    config = PieConfig(auth=AuthConfig(enabled=False), model=models, supervision=SupervisionConfig(start_s=3.0))
    with pytest.raises(ray.exceptions.RayActorError, match=r"not placed and started within 3\.0 s"):
        start_controller(config)
    deadline = time.monotonic() + 30
    while (left := set(ray.util.list_named_actors()) - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def test_an_actor_whose_process_died_is_reported_with_why_ray_saw_it_die(ray_session):
    """What `pie start` adds to a bare "the actor died unexpectedly" when its controller's process dies: Ray's own
    record of the death, read from its state API."""

    @ray.remote(num_cpus=0)
    class Doomed:
        def pid(self) -> int:
            return os.getpid()

    doomed = Doomed.remote()
    os.kill(ray.get(doomed.pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed.pid.remote(), timeout=60)
    why = death_cause(doomed._actor_id.hex())
    assert why is not None and "worker process has died" in why, why
