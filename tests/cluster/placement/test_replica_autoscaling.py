"""Replicas that follow the load: an autoscaled model (``min_replicas = 1``, ``max_replicas = 2``) gets a second
replica while inferlets hold more contexts than one replica's ``target_load``; the controller, killed then, comes
back with the target and both replicas; the model gives the second back once the load is gone — its ranks stopped
and its placement group removed, so Ray's autoscaler could take the node away — and the cluster serves on.
``pie status`` says each step's target and why."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.ingress.metrics import ScalingGauges
from prometheus_client import CollectorRegistry, generate_latest
from ray.util.state import list_actors
from support.launching import HOLD, autoscaled_config, launch, replica_groups, run_to_end, upload

GREEDY = """
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("after the scale-down")
        return await ctx.generate(Sampler.argmax(), max_tokens=3, stop=[]).collect_tokens()
"""


def scaling(controller):
    status = ray.get(controller.status.remote())
    (scale,) = status.scaling
    return scale, status.replicas


def wait_for(controller, replicas: int, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        scale, rows = scaling(controller)
        if scale.current == len(rows) == replicas and all(r.state == "serving" for r in rows):
            return scale, rows
        time.sleep(0.3)
    raise AssertionError(f"not {replicas} serving replicas within {timeout_s} s: {scaling(controller)}")


def metrics_text(controller) -> str:
    """The scaling gauges as the ingress's ``/metrics`` sets them from the controller's ``scaling`` answer."""
    registry = CollectorRegistry()
    ScalingGauges(registry).set(ray.get(controller.scaling.remote()))
    return generate_latest(registry).decode()


@pytest.mark.slow
def test_an_autoscaled_model_adds_a_replica_under_load_and_gives_it_back(ray_cluster, ray_session):
    config = autoscaled_config()
    groups_before = replica_groups()
    controller = start_controller(config)  # restartable, as `pie start` makes it
    try:
        launcher = ray.get_actor("pie-launcher")
        scale, _ = scaling(controller)
        assert (scale.min_replicas, scale.max_replicas, scale.target, scale.current) == (1, 2, 1, 1)
        assert replica_groups() == groups_before + 1

        hold = upload(launcher, HOLD)
        holders = [launch(launcher, hold) for _ in range(3)]  # 3 contexts at 2 per replica: 2 replicas wanted
        began = time.monotonic()
        scale, rows = wait_for(controller, 2)
        print(f"second replica serving {time.monotonic() - began:.1f} s after the load came")
        # 3 contexts, each counted once, whether or not a pass of it waits for a batch at that reading
        assert scale.target == 2 and "load 3 (live contexts) at 2 per replica" in scale.reason, scale
        assert len(rows) == 2 and replica_groups() == groups_before + 2  # its own one-bundle group
        exposed = metrics_text(controller)  # what the ingress's /metrics shows of it
        assert 'pie_model_replicas{model="default"} 2.0' in exposed
        assert 'pie_model_target_replicas{model="default"} 2.0' in exposed

        os.kill(ray.get(controller.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
        status = ray.get(controller.status.remote(), timeout=120)  # answered by the restarted controller
        (scale,) = status.scaling
        assert status.controller_restarts == 1 and (scale.target, scale.current) == (2, 2), status
        assert [r.state for r in status.replicas] == ["serving", "serving"] and replica_groups() == groups_before + 2

        for instance in holders:
            ray.get(launcher.abort.remote("alice", instance))
        began = time.monotonic()
        scale, rows = wait_for(controller, 1)
        print(f"back to one replica {time.monotonic() - began:.1f} s after the load went")
        assert scale.target == 1 and "load 0" in scale.reason and "min_replicas 1" in scale.reason, scale
        deadline = time.monotonic() + 60  # the removed replica's group goes once its ranks have stopped
        while replica_groups() != groups_before + 1 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert replica_groups() == groups_before + 1
        alive = {a["name"] or "" for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)}
        assert not [name for name in alive if name.startswith("pie-replica/default/1/")], alive

        last = run_to_end(launcher, launch(launcher, upload(launcher, GREEDY)))[-1]
        assert last[1] == "return" and len(json.loads(last[2])) == 3, last
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
    assert replica_groups() == groups_before


PAUSED = """
import asyncio
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("a replica starts while another dies")
        first = await ctx.generate(Sampler.argmax(), max_tokens=2, stop=[]).collect_tokens()
        await asyncio.sleep(4)  # its context held: the load that wants a second replica
        return first + await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
"""


@pytest.mark.slow
def test_a_replica_dies_while_the_autoscaler_adds_another(ray_cluster, ray_session):
    """Replica 0 is SIGKILLed while replica 1 is starting for the load: the supervisor replaces replica 0 as the
    scaler finishes adding replica 1, and the inferlets that held contexts on replica 0 finish with the tokens of an
    undisturbed run (their contexts recomputed where they moved)."""
    config = autoscaled_config(downscale_delay_s=600)
    controller = start_controller(config)
    try:
        launcher = ray.get_actor("pie-launcher")
        paused = upload(launcher, PAUSED)
        undisturbed = run_to_end(launcher, launch(launcher, paused))[-1]
        assert undisturbed[1] == "return", undisturbed
        (first,) = ray.get(controller.status.remote()).replicas

        held = [launch(launcher, paused) for _ in range(3)]
        deadline = time.monotonic() + 60
        while scaling(controller)[0].target < 2:  # the scaler is starting replica 1 now
            assert time.monotonic() < deadline, scaling(controller)
            time.sleep(0.2)
        assert scaling(controller)[0].current == 1
        os.kill(first.pids[0], signal.SIGKILL)

        endings = [run_to_end(launcher, instance, timeout=240)[-1] for instance in held]
        assert [e[1:] for e in endings] == [undisturbed[1:]] * 3, endings  # ("return", the same tokens)
        scale, rows = wait_for(controller, 2)
        assert scale.target == 2 and rows[0].pids[0] != first.pids[0]  # replica 0 is its replacement
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)
