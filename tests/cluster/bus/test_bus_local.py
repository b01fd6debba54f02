"""The bus's hand-off in one process: a push meets a pull waiting in the same process without a trip to the shard.

What it changes is observable and stated in ``inferlet.messaging``: pulls waiting in the pusher's process are served
before longer-waiting ones elsewhere. What it keeps: every message is received exactly once, also when the shard
had already sent one to a pull that a local push served meanwhile (it goes back to the queue), and an inferlet's
pushes keep their order whichever way each one went (``test_bus.py``'s competing pullers, which share one process,
check that too). The other process here is a Ray task, as a second host would be.
"""

from __future__ import annotations

import asyncio

import ray
from inferlet import messaging
from pie_cluster.hosts.run import run_inferlet
from support.bus_calls import BUS, NOTHING_HELD, wait_for_stats
from support.sdk_host import TRUST


@ray.remote(num_cpus=0)
def elsewhere(user: str, identity: dict, job: str, n: int) -> list[str]:
    """An inferlet in another process: pulls once (``job`` "pull") or pushes ``n`` messages ("push")."""
    from pie_cluster.bus import find_bus

    async def main(input):
        if job == "pull":
            return [await messaging.pull("q")]
        for i in range(n):
            messaging.push("q", f"r{i}")
            if i % 8 == 7:
                await asyncio.sleep(0.001)
        return []

    return asyncio.run(run_inferlet(main, {}, {}, user, **identity, bus=find_bus(BUS).addresses()))


def here(bus, user: str, main):
    """``main`` as an inferlet in this process, as a host runs one."""
    return run_inferlet(main, {}, {}, user, **TRUST.instance(user), bus=bus.addresses())


def test_a_pull_waiting_in_the_pushers_process_is_served_before_a_longer_waiting_one_elsewhere(bus, user):
    remote = elsewhere.remote(user, TRUST.instance(user), "pull", 0)

    async def scenario():
        await wait_for_stats(bus, user, waiters=1)  # the other process's pull waits on the shard
        local = asyncio.ensure_future(here(bus, user, lambda _: messaging.pull("q")))
        await wait_for_stats(bus, user, waiters=2)

        async def pusher(_):
            messaging.push("q", "first")  # a pull waits in this process: handed over here
            await local
            messaging.push("q", "second")  # none waits here any more: through the bus, to the other process

        await here(bus, user, pusher)
        return await local

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == "first"
    assert ray.get(remote, timeout=60) == ["second"]
    assert bus.stats(user) == NOTHING_HELD


def test_pushes_from_this_process_and_another_reach_one_puller_each_exactly_once(bus, user):
    """A local pusher races a remote one to a local puller: local pushes are handed over while the puller waits,
    so the shard's answers to pulls that were served meanwhile must go back to the queue, not be lost or doubled."""
    n = 300
    remote = elsewhere.remote(user, TRUST.instance(user), "push", n)

    async def puller(_):
        return [await messaging.pull("q") for _ in range(2 * n)]

    async def pusher(_):
        for i in range(n):
            messaging.push("q", f"p{i}")
            await asyncio.sleep(0)

    async def scenario():
        got, _ = await asyncio.gather(here(bus, user, puller), here(bus, user, pusher))
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 120))
    ray.get(remote, timeout=60)
    assert sorted(got) == sorted([f"p{i}" for i in range(n)] + [f"r{i}" for i in range(n)])
    assert [m for m in got if m[0] == "p"] == [f"p{i}" for i in range(n)]  # this process's pusher keeps its order
    assert bus.stats(user) == NOTHING_HELD
