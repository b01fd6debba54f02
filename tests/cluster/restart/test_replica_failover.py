"""Uploaded inferlets, in their sandboxed workers, outlive the replica they run on: 32 of them wait half way through a
greedy generation while their replica's leader is SIGKILLed, then finish on another replica of the model (through
the socket of it bound into their sandbox) with the tokens they would have made without the failure. A model of one
replica has only its replacement to go to, on sockets made after the sandbox was: the host's relay reaches it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from pie_cluster.bus import BusStats
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.control.status_records import ReplicaStatus
from support.halves import HALVES, run_halves
from support.launching import upload

INSTANCES = 32


@pytest.fixture(scope="module")
def cluster(ray_session):
    """ "default": two replicas, one per node; "solo": one. Probed every second, so a dead one is soon replaced."""
    models = [
        ModelConfigEntry(name="default", replicas=2, pages=256, cpus_per_rank=1),
        ModelConfigEntry(name="solo", replicas=1, pages=256, cpus_per_rank=1),
    ]
    supervision = SupervisionConfig(probe_every_s=1.0, probe_deadline_s=3.0, misses=2)
    controller = start_controller(PieConfig(auth=AuthConfig(enabled=False), model=models, supervision=supervision))
    yield controller
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def replica(controller, model: str, index: int = 0) -> ReplicaStatus:
    rows = ray.get(controller.status.remote()).replicas
    return next(r for r in rows if (r.model, r.replica) == (model, index))


def killer(controller, model: str):
    def kill():
        os.kill(replica(controller, model).pids[0], signal.SIGKILL)

    return kill


def test_inferlets_finish_on_the_other_replica_with_the_same_tokens(cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, HALVES)
    doomed = replica(cluster, "default")
    expected = run_halves(launcher, program, "default", doomed.node)
    assert all(r["moves"] == 0 and len(r["tokens"]) == 24 for r in expected)

    got = run_halves(launcher, program, "default", doomed.node, kill=killer(cluster, "default"))

    assert [r["moves"] for r in got] == [1] * INSTANCES
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]


def test_a_model_of_one_replica_continues_on_its_replacement(cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, HALVES)
    before = replica(cluster, "solo")
    expected = run_halves(launcher, program, "solo", before.node)

    got = run_halves(launcher, program, "solo", before.node, kill=killer(cluster, "solo"))

    assert [r["moves"] for r in got] == [1] * INSTANCES
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]
    after = replica(cluster, "solo")
    assert after.state == "serving" and not set(after.pids) & set(before.pids), (before, after)


def test_a_killed_controller_is_restarted_and_adopts_its_cluster(cluster):
    """Last in the module: the controller's process is SIGKILLed while instances wait half way. Ray restarts it; it
    adopts the running replicas, hosts, bus and launcher (none restarted), the instances finish with their tokens,
    and its supervisor works again: a replica killed afterwards is replaced."""
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, HALVES)
    before = ray.get(cluster.status.remote())
    node = replica(cluster, "default").node
    expected = run_halves(launcher, program, "default", node, count=8)

    def kill_controller():
        os.kill(ray.get(cluster.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
        killed = time.monotonic()
        status = ray.get(cluster.status.remote(), timeout=120)  # retried on the restarted controller
        print(f"controller answering {time.monotonic() - killed:.1f} s after its kill")
        assert status.controller_restarts == 1
        assert [r.pids for r in status.replicas] == [r.pids for r in before.replicas]
        assert [n.node for n in status.nodes] == [n.node for n in before.nodes]
        assert all(n.host == "serving" for n in status.nodes) and isinstance(status.bus, BusStats)

    got = run_halves(launcher, program, "default", node, kill=kill_controller, count=8)
    assert [r["moves"] for r in got] == [0] * 8
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]

    doomed = replica(cluster, "solo")
    os.kill(doomed.pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (now := replica(cluster, "solo")).state != "serving" or now.pids == doomed.pids:
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    assert ray.get(cluster.status.remote()).replica_restarts >= 1
