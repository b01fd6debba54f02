"""The relay an inferlet fails over to last (``hosts/replica_relay.py``) reaches a replica of the model that serves
now. An inferlet opens more than one connection to it (its awaited calls and its blocking ones go on sockets of
their own) and its contexts live on one replica, so every connection of one instance reaches the same replica, even
when the services' order changed in between (as when a dead replica's replacement comes up beside another).

Two real replicas of the tiny model; the inferlet runs in this process as a host runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
import ray
from inferlet import Context, Model, Sampler
from pie_cluster.hosts.replica_relay import ReplicaRelays
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from support.sdk_host import TRUST, one_cpu_replica


@pytest.fixture(scope="module")
def replicas(ray_session, tiny_llama):
    made = [one_cpu_replica(tiny_llama) for _ in range(2)]
    yield made
    for replica in made:
        replica.shutdown()


async def generate(input):
    with Context(Model.load("default")) as ctx:  # made and released by blocking calls, on a socket of their own
        ctx.user("through the relay").cue()
        return await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()


def test_an_instances_connections_through_the_relay_all_reach_one_replica(replicas):
    (first,), (second,) = (endpoints_for("default", replica).values() for replica in replicas)
    asked = itertools.count()

    def candidates(model: str) -> list[str]:
        """The services' order flips after the first connection: a naive relay sends the second elsewhere."""
        order = [first.address, second.address]
        return order if next(asked) == 0 else order[::-1]

    relays = ReplicaRelays(candidates)
    before = [ray.get(r.leader.engine_stats.remote()) for r in replicas]
    try:
        address = asyncio.run(relays.address_for("default"))
        endpoint = dataclasses.replace(first, address=address, failover=())
        run = run_inferlet(generate, {}, {"default": endpoint}, "alice", **TRUST.instance("alice"))
        tokens = asyncio.run(run)
    finally:
        relays.close()

    assert len(tokens) == 4
    assert next(asked) >= 2, "two connections (blocking and awaited), each asking the candidates afresh"
    after = [ray.get(r.leader.engine_stats.remote()) for r in replicas]
    served = [a.requests - b.requests for a, b in zip(after, before, strict=True)]
    assert served[0] > 0 and served[1] == 0, served  # where the first connection went
    assert [a.contexts for a in after] == [0, 0], "the context was released where it was made"
