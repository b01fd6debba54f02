"""Inferlets outlive a replica that leaves while it still answers (drained, scaled down): it hands their contexts to
another replica with their KV pages (``control.handover``, as ``pie drain`` and the scaler call it), each link
claims them there, and the inferlets go on with the tokens an unmoved run gives, nothing recomputed. One that was
idle meanwhile claims them when it finds the replica gone; a replica that died leaves only recompute. A
tensor-parallel group hands each rank's share of the KV heads to the same rank of a group of its size; a replica of
another size refuses the pages, and the inferlets recompute.

Real replicas of the tiny model on Ray; the inferlets run in this process as a host runs them."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray
from inferlet import Context, Model, Sampler
from pie_cluster.control.handover import hand_over
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings
from support.sdk_host import TRUST, failing_over, one_cpu_replica

TOKENS = 24
INFERLETS = 8


@pytest.fixture(scope="module")
def survivor(ray_session, tiny_llama):
    replica = one_cpu_replica(tiny_llama)
    yield replica
    replica.shutdown()


@pytest.fixture
def leaving(ray_session, tiny_llama):
    replica = one_cpu_replica(tiny_llama)
    yield replica
    replica.shutdown()


@pytest.fixture
def two_ranks(ray_session, tiny_llama):
    """Tensor-parallel replicas of two ranks (one CPU each), made on demand and shut down after the test."""
    made = []

    def make() -> Replica:
        settings = RunnerSettings(num_pages=512, backend="torch")
        made.append(Replica(tiny_llama, 2, settings, cpus_per_rank=1, engine=BatchLimits(), secret=TRUST.secret))
        return made[-1]

    yield make
    for replica in made:
        replica.shutdown()


def stats(replica: Replica):
    return ray.get(replica.leader.engine_stats.remote())


def link() -> tuple[int, int]:
    model = Model.load("default")
    return model.link.moves, model.link.transferred


def generating(halfway: asyncio.Event | None, moved: asyncio.Event | None):
    """A context and a fork of it, each generating greedily; half way (``halfway``), the inferlet waits until the
    replica has left (``moved``; None: it goes on generating meanwhile). Returns both token lists and (moves,
    contexts transferred)."""

    async def main(input):
        ctx = Context(Model.load("default"))
        ctx.user(input["prompt"]).cue()
        first = await ctx.generate(Sampler.argmax(), max_tokens=TOKENS // 2, stop=[]).collect_tokens()
        other = ctx.fork()
        other.user("and then?").cue()
        if halfway is not None:
            halfway.set()
        if moved is not None:
            await moved.wait()
        rest = await ctx.generate(Sampler.argmax(), max_tokens=TOKENS * 3, stop=[]).collect_tokens()
        branch = await other.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
        return first + rest, branch, link()

    return main


def run_all(endpoints, around=None, busy: bool = False) -> list:
    """``INFERLETS`` inferlets on ``endpoints``; ``around()`` runs once all are half way, while they wait for it
    (or, ``busy``, while they go on generating)."""

    async def main():
        halfways = [asyncio.Event() for _ in range(INFERLETS)] if around else [None] * INFERLETS
        moved = asyncio.Event()
        waits = moved if around is not None and not busy else None
        runs = [
            run_inferlet(generating(halfways[i], waits), {"prompt": f"story {i}"}, endpoints, "alice",
                         **TRUST.instance("alice"))
            for i in range(INFERLETS)
        ]  # fmt: skip
        if around is not None:

            async def mover():
                await asyncio.gather(*(h.wait() for h in halfways))
                await around()
                moved.set()

            runs.append(mover())
        return (await asyncio.gather(*runs))[:INFERLETS]

    return asyncio.run(main())


def hand_over_half_way(leaving: Replica, survivor: Replica) -> None:
    """Inferlets half way on ``leaving`` when it hands its contexts to ``survivor`` go on with the tokens of a run
    that never moved, each link having moved once and taken both its contexts up with their KV."""
    expected = run_all(endpoints_for("default", survivor))

    async def leave():
        what = await asyncio.to_thread(hand_over, leaving, survivor)
        assert what == f"{2 * INFERLETS} contexts and 0 snapshots moved with their KV"

    got = run_all(failing_over(leaving, survivor), leave)

    assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in expected]
    assert [moved for _, _, moved in got] == [(1, 2)] * INFERLETS, "each link moved once, both contexts with KV"


def test_a_leaving_replica_hands_its_contexts_over_and_the_inferlets_go_on_with_the_same_tokens(leaving, survivor):
    before = stats(survivor)
    hand_over_half_way(leaving, survivor)
    after = stats(survivor)
    assert after.moved_in - before.moved_in == 2 * INFERLETS
    assert after.claimed - before.claimed == 2 * INFERLETS, "every moved context was taken up, none recomputed"
    gone = stats(leaving)
    assert (gone.contexts, gone.moved_out, gone.unnotified) == (0, 2 * INFERLETS, 0)


def test_inferlets_generating_while_their_replica_leaves_go_on_with_the_same_tokens(leaving, survivor):
    """Passes in flight finish where they are; those sent meanwhile are answered with where the contexts went."""
    expected = run_all(endpoints_for("default", survivor))

    async def leave():
        await asyncio.to_thread(hand_over, leaving, survivor)

    got = run_all(failing_over(leaving, survivor), leave, busy=True)

    assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in expected]
    moved = [m for _, _, m in got]
    assert all(transferred == 2 * moves for moves, transferred in moved), moved
    assert sum(moves for moves, _ in moved) >= INFERLETS // 2, "most were still generating when it left"


def test_an_idle_inferlet_claims_its_moved_contexts_when_it_finds_the_replica_gone(leaving, survivor):
    """Scaled down: the replica handed its contexts over and stopped before the inferlet's next call."""
    expected = run_all(endpoints_for("default", survivor))

    async def leave_and_stop():
        await asyncio.to_thread(hand_over, leaving, survivor)
        os.kill(ray.get(leaving.leader.ping.remote()), signal.SIGKILL)

    got = run_all(failing_over(leaving, survivor), leave_and_stop)

    assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in expected]
    assert [moved for _, _, moved in got] == [(1, 2)] * INFERLETS


def test_a_dead_replica_leaves_its_inferlets_to_recompute(leaving, survivor):
    expected = run_all(endpoints_for("default", survivor))

    async def die():
        os.kill(ray.get(leaving.leader.ping.remote()), signal.SIGKILL)

    got = run_all(failing_over(leaving, survivor), die)

    assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in expected]
    assert [moved for _, _, moved in got] == [(1, 0)] * INFERLETS, "moved once, nothing transferred: recomputed"


def test_a_tensor_parallel_group_hands_each_ranks_pages_to_the_same_rank_of_another(two_ranks):
    leaving, survivor = two_ranks(), two_ranks()
    hand_over_half_way(leaving, survivor)
    assert stats(survivor).claimed == 2 * INFERLETS, "every moved context was taken up, none recomputed"


def test_a_group_of_another_size_refuses_the_pages_and_the_inferlets_recompute(two_ranks, survivor):
    leaving = two_ranks()
    expected = run_all(endpoints_for("default", survivor))
    before = stats(survivor)

    async def leave_and_stop():
        assert await asyncio.to_thread(hand_over, leaving, survivor) is None, "one rank cannot take two ranks' pages"
        os.kill(ray.get(leaving.leader.ping.remote()), signal.SIGKILL)

    got = run_all(failing_over(leaving, survivor), leave_and_stop)

    assert [(a, b) for a, b, _ in got] == [(a, b) for a, b, _ in expected]
    assert [moved for _, _, moved in got] == [(1, 0)] * INFERLETS, "moved once, nothing transferred: recomputed"
    assert stats(survivor).moved_in == before.moved_in
