"""A part of the cluster that hangs (its process SIGSTOPped: alive, answering nothing). The market fails what needs
it with an error naming it once its deadline (``pie_workers.deadlines``) passes, instead of hanging the caller, and
serves again once continued (SIGCONT); a node's inferlet host misses its pings, is killed and restarted by Ray."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager, suppress

import pytest
import ray
from pie_cluster.bus import BusStats
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.control.status_records import Unanswered
from pie_cluster.hosts.driver_events import poll
from pie_workers.deadlines import MARKET_S
from ray.util.state import list_actors
from support.launching import launch, run_to_end, upload

GREEDY = """
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("anyone there?")
        return await ctx.generate(Sampler.argmax(), max_tokens=3, stop=[]).collect_tokens()
"""

PARKED = """
from inferlet import session

async def main(input):
    session.send("parked")
    return await session.receive()
"""


@pytest.fixture(scope="module")
def small_cluster(ray_session):
    supervision = SupervisionConfig(probe_every_s=1.0, probe_deadline_s=3.0, misses=2)
    config = PieConfig(auth=AuthConfig(enabled=False), model=[ModelConfigEntry(pages=64)], supervision=supervision)
    controller = start_controller(config, detached=False)
    yield controller
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def pid_of(ray_cluster, **match) -> int:
    """The process of the one live actor of this session's namespace with these fields (name, class_name, node_id)."""
    found = [
        a
        for a in list_actors(ray_cluster.address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000)
        if a["ray_namespace"] == "pie-test" and all(a.get(k) == v for k, v in match.items())
    ]
    assert len(found) == 1, found
    return found[0]["pid"]


@contextmanager
def stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):  # killed as hung: nothing to continue
            os.kill(pid, signal.SIGCONT)


def test_a_hung_market_fails_a_launch_with_an_error_naming_it(small_cluster, ray_cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, GREEDY)
    with stopped(pid_of(ray_cluster, name="pie-market")):
        began = time.monotonic()
        last = run_to_end(launcher, launch(launcher, program), timeout=MARKET_S + 120)[-1]
        print(f"hung market -> error event after {time.monotonic() - began:.1f} s")
    assert last[1] == "error" and f"the market did not answer within {MARKET_S:g} s" in last[2], last
    assert run_to_end(launcher, launch(launcher, program))[-1][1] == "return"  # continued, it serves again


def test_a_hung_inferlet_host_is_killed_and_restarted_and_its_instance_fails(small_cluster, ray_cluster):
    launcher = ray.get_actor("pie-launcher")
    head = ray.get_runtime_context().get_node_id()
    parked, program = upload(launcher, PARKED), upload(launcher, GREEDY)
    waiting = launch(launcher, parked, node_id=head)
    assert poll(launcher, "alice", waiting, 0, 60.0).events[0][1:] == ["message", "parked"]
    hung = pid_of(ray_cluster, class_name="InferletHost", node_id=head)
    with stopped(hung):
        began = time.monotonic()
        last = run_to_end(launcher, waiting)[-1]  # it misses its pings, the launcher kills it, Ray restarts it
        print(f"hung host -> its instance failed after {time.monotonic() - began:.1f} s")
    assert last[1] == "error" and f"host on node {head} died" in last[2], last
    for _ in range(240):  # launches on the node are refused until the restarted host answers
        try:
            instance = launch(launcher, program, node_id=head)
            break
        except ray.exceptions.RayTaskError as e:
            assert "is down" in str(e), e
            time.sleep(0.5)
    assert run_to_end(launcher, instance)[-1][1] == "return"
    assert pid_of(ray_cluster, class_name="InferletHost", node_id=head) != hung


def test_a_hung_bus_shard_shows_unresponsive_in_status_instead_of_hanging_it(small_cluster, ray_cluster):
    with stopped(pid_of(ray_cluster, name="pie-bus-0")):
        assert ray.get(small_cluster.status.remote()).bus == Unanswered("unresponsive")
    assert isinstance(ray.get(small_cluster.status.remote()).bus, BusStats)  # continued, it answers again
