"""Any rank of a tensor-parallel group that dies or hangs gets its whole group replaced: the follower (rank 1) of a
2-rank replica is SIGKILLed, then (in its replacement) SIGSTOPped. Each time the replica goes ``restarting``, then
``serving`` with a higher restart count, on new processes, and greedy generation gives the same tokens as before.
Then the follower is killed under 16 inferlets half way through their generation: they finish on the replacement
with the tokens they would have made without the failure; and the leader is killed under an inferlet whose next
call blocks (``fork``): it waits for the replacement longer than its worker's stall limit, and is not ended for it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SandboxConfig, SupervisionConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.control.status_records import ReplicaStatus
from support.halves import HALVES, run_halves, wait_for_message
from support.launching import launch, run_to_end, upload

STALL_S = 2.0  # shorter than a replacement takes: a blocking call waiting for one must not count as a stall

GREEDY = """
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("which rank answers?")
        return await ctx.generate(Sampler.argmax(), max_tokens=6, stop=[]).collect_tokens()
"""


@pytest.fixture(scope="module")
def tp_cluster(ray_session):
    """One replica of the tiny model as a 2-rank tensor-parallel group, probed every second with a 3 s deadline."""
    model = ModelConfigEntry(pages=128, cpus_per_rank=1, tensor_parallel=2)
    supervision = SupervisionConfig(probe_every_s=1.0, probe_deadline_s=3.0, misses=2)
    sandbox = SandboxConfig(stall_s=STALL_S)
    config = PieConfig(auth=AuthConfig(enabled=False), model=[model], supervision=supervision, sandbox=sandbox)
    controller = start_controller(config, detached=False)
    yield controller
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def replica_row(controller) -> ReplicaStatus:
    (row,) = ray.get(controller.status.remote()).replicas
    return row


def greedy(launcher, program: str) -> list[int]:
    last = run_to_end(launcher, launch(launcher, program))[-1]
    assert last[1] == "return", last
    return json.loads(last[2])


def recovered(controller, restarts: int, bound_s: float = 240) -> tuple[ReplicaStatus, list[str], float]:
    """Poll ``pie status`` until the replica serves again after ``restarts``: its row, the states seen, the time."""
    started, seen = time.monotonic(), []
    while time.monotonic() - started < bound_s:
        status = ray.get(controller.status.remote())
        (row,) = status.replicas
        seen.append(row.state)
        if status.replica_restarts >= restarts and row.state == "serving":
            return row, seen, time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"the replica did not serve again within {bound_s} s; states seen: {seen}")


def test_a_killed_follower_rank_replaces_its_tensor_parallel_group(tp_cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, GREEDY)
    before = replica_row(tp_cluster)
    assert before.state == "serving" and before.tensor_parallel == 2 and None not in before.pids, before
    tokens = greedy(launcher, program)

    os.kill(before.pids[1], signal.SIGKILL)  # the follower, not the leader the controller used to probe alone
    after, seen, took = recovered(tp_cluster, restarts=1)
    print(f"follower SIGKILL -> serving again in {took:.1f} s")
    assert "restarting" in seen, seen
    assert not set(after.pids) & set(before.pids), (before, after)  # a new group, leader included
    assert greedy(launcher, program) == tokens


def test_a_hung_follower_rank_is_detected_by_its_probe_deadline_and_replaced(tp_cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, GREEDY)
    tokens = greedy(launcher, program)
    restarts = ray.get(tp_cluster.status.remote()).replica_restarts
    hung = replica_row(tp_cluster).pids[1]
    os.kill(hung, signal.SIGSTOP)  # alive, but answers nothing
    try:
        after, seen, took = recovered(tp_cluster, restarts=restarts + 1)
        print(f"follower SIGSTOP -> serving again in {took:.1f} s")
        assert {"unresponsive", "restarting"} & set(seen), seen
        assert hung not in after.pids
    finally:
        with contextlib.suppress(ProcessLookupError):  # Ray killed it; if not, it must not stay stopped
            os.kill(hung, signal.SIGCONT)
    assert greedy(launcher, program) == tokens


def test_inferlets_running_when_a_follower_dies_finish_on_the_replacement_with_the_same_tokens(tp_cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, HALVES)
    node = replica_row(tp_cluster).node
    expected = run_halves(launcher, program, "default", node, count=16)

    def kill_follower():
        os.kill(replica_row(tp_cluster).pids[1], signal.SIGKILL)

    got = run_halves(launcher, program, "default", node, kill=kill_follower, count=16)

    assert [r["moves"] for r in got] == [1] * 16
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]


BLOCKS = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    ctx = Context(Model.load("default"))
    ctx.user("a blocking call waits for the replacement").cue()
    await ctx.flush()
    session.send("ready")
    await session.receive()
    child = ctx.fork()  # blocks: finds the replica gone and waits, holding the loop, until its replacement serves
    return await child.generate(Sampler.argmax(), max_tokens=6, stop=[]).collect_tokens()
"""


def test_a_blocking_call_that_waits_for_the_replacement_is_not_a_stall(tp_cluster):
    launcher = ray.get_actor("pie-launcher")
    program = upload(launcher, BLOCKS)

    def run(kill=None) -> list:
        instance = launch(launcher, program)
        wait_for_message(launcher, instance)
        if kill is not None:
            kill()
        host = ray.get(launcher.locate.remote("alice", instance)).host
        ray.get(host.send.remote("alice", instance, "message", "go on"))
        last = run_to_end(launcher, instance)[-1]
        assert last[1] == "return", last
        return json.loads(last[2])

    def kill_leader():
        os.kill(replica_row(tp_cluster).pids[0], signal.SIGKILL)
        killed.append(time.monotonic())

    expected = run()
    restarts, killed = ray.get(tp_cluster.status.remote()).replica_restarts, []
    got = run(kill=kill_leader)
    took = time.monotonic() - killed[0]
    print(f"the blocked inferlet finished {took:.1f} s after the kill (stall limit {STALL_S:g} s)")
    assert got == expected
    assert ray.get(tp_cluster.status.remote()).replica_restarts > restarts and took > STALL_S
