"""Inferlets outlive their replica: when it dies, each context is recomputed from its lineage on the replica the
endpoint names to fail over to, the passes that had no answer run again there, and the inferlet goes on as if
nothing happened (greedy decoding: the same tokens). A context that cannot be recomputed raises ``ContextLost``.

Two real replicas of the tiny model; the first is SIGKILLed while 32 inferlets decode on it."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray
from inferlet import Context, ContextLost, Model, Sampler
from inferlet._channel import ReplicaLost
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_workers.replica import Replica
from support.sdk_host import TRUST, failing_over, one_cpu_replica

TOKENS = 40  # each inferlet's greedy tokens
KILL_AFTER = 32 * 6  # steps the stepping inferlets have made, all together, when the replica is killed


@pytest.fixture(scope="module")
def survivor(ray_session, tiny_llama):
    """The replica the inferlets move to."""
    replica = one_cpu_replica(tiny_llama)
    yield replica
    replica.shutdown()


@pytest.fixture
def doomed(ray_session, tiny_llama):
    """The replica the inferlets start on, killed by the test."""
    replica = one_cpu_replica(tiny_llama)
    yield replica
    replica.shutdown()  # dead, as it should be: its bundle is given back all the same


def kill(replica: Replica) -> None:
    os.kill(ray.get(replica.leader.ping.remote()), signal.SIGKILL)


class Progress:
    """Steps made by the stepping inferlets; ``reached`` once there are ``n``."""

    def __init__(self, n: int):
        self.steps, self.reached = 0, asyncio.Event()
        self._n = n

    def step(self) -> None:
        self.steps += 1
        if self.steps >= self._n:
            self.reached.set()


def programs(progress: Progress | None):
    """Three ways through a generation: one pass per step (with steps run ahead), chained passes (the collectors),
    and a fork half way whose two branches go on. Each returns its tokens, how often its link moved and how many
    calls it sent again."""

    def moved() -> tuple[int, int]:
        link = Model.load("default").link
        return link.moves, link.resent

    def ctx_for(input) -> Context:
        ctx = Context(Model.load("default"))
        ctx.user(input["prompt"]).cue()
        return ctx

    async def stepped(input):
        ctx = ctx_for(input)
        tokens = []
        async for step in ctx.generate(Sampler.argmax(), max_tokens=TOKENS, stop=[]):
            tokens += (await step.execute()).tokens
            if progress is not None:
                progress.step()
        return tokens, moved()

    async def chained(input):
        ctx = ctx_for(input)
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=TOKENS, stop=[]).collect_tokens()
        return tokens, moved()

    async def forked(input):
        ctx = ctx_for(input)
        first = await ctx.generate(Sampler.argmax(), max_tokens=TOKENS // 2, stop=[]).collect_tokens()
        other = ctx.fork()
        other.user("and then?").cue()
        rest = await ctx.generate(Sampler.argmax(), max_tokens=TOKENS // 2, stop=[]).collect_tokens()
        branch = await other.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
        return first + rest + branch, moved()

    return [stepped, chained, forked]


def run_all(endpoints, progress: Progress | None = None, doomed: Replica | None = None) -> list:
    """32 inferlets (the three programs in turn, each its own prompt) on ``endpoints``; ``doomed`` is killed once
    ``progress`` is reached."""

    async def main():
        mains = programs(progress)
        runs = [
            run_inferlet(mains[i % 3], {"prompt": f"tell story {i}"}, endpoints, "alice", **TRUST.instance("alice"))
            for i in range(32)
        ]
        if doomed is not None:

            async def killer():
                await progress.reached.wait()
                kill(doomed)

            runs.append(killer())
        return (await asyncio.gather(*runs))[:32]

    return asyncio.run(main())


def test_32_inferlets_finish_with_the_same_tokens_after_their_replica_is_killed(doomed, survivor):
    expected = run_all(endpoints_for("default", survivor))
    assert all(moved == (0, 0) and len(tokens) >= TOKENS for tokens, moved in expected)

    got = run_all(failing_over(doomed, survivor), Progress(KILL_AFTER), doomed)

    assert [moves for _, (moves, _) in got] == [1] * 32, "every inferlet was on the killed replica and moved once"
    assert sum(resent for _, (_, resent) in got) > 0, "passes in flight when it died were sent again"
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]


def test_a_context_that_cannot_be_recomputed_is_lost_with_a_clear_error_and_the_others_go_on(doomed, survivor):
    ready, killed = asyncio.Event(), asyncio.Event()

    async def main(input):
        model = Model.load("default")
        plain = Context(model)
        plain.user("keep me").cue()
        await plain.flush()
        masked = Context(model)
        await masked.forward().input([5, 6, 7]).attention_mask([[0, 1], [0, 2], [1, 2]]).execute()
        ready.set()
        await killed.wait()
        child = plain.fork()  # a blocking call finds the replica gone and moves the link itself
        tokens = await child.generate(Sampler.argmax(), max_tokens=6, stop=[]).collect_tokens()
        with pytest.raises(ContextLost, match="custom attention mask"):
            await masked.forward().input([8]).execute()
        with pytest.raises(ContextLost, match="is lost"):
            masked.fork()
        masked.release()  # releasing a lost context is harmless
        return tokens, model.link.moves

    tokens, moves = asyncio.run(killed_midway(main, failing_over(doomed, survivor), doomed, ready, killed))
    assert len(tokens) == 6 and moves == 1


def test_without_a_failover_address_a_dead_replica_fails_the_pass(doomed):
    ready, killed = asyncio.Event(), asyncio.Event()

    async def main(input):
        ctx = Context(Model.load("default"))
        ctx.user("hello").cue()
        await ctx.flush()
        ready.set()
        await killed.wait()
        await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()

    with pytest.raises(ReplicaLost, match="lost the connection|cannot reach"):
        asyncio.run(killed_midway(main, endpoints_for("default", doomed), doomed, ready, killed))


async def killed_midway(main, endpoints, doomed: Replica, ready: asyncio.Event, killed: asyncio.Event):
    """Run ``main``, killing ``doomed`` once it is ``ready`` and telling it so through ``killed``."""
    instance = asyncio.ensure_future(run_inferlet(main, {}, endpoints, "alice", **TRUST.instance("alice")))
    await asyncio.wait([instance, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    kill(doomed)
    killed.set()
    return await instance
