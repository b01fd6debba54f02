"""The message bus, what it keeps apart and what it leaves behind: topics are per user, bad arguments and a missing
bus are clear errors, an inferlet that ends badly or whose host is killed leaves nothing on the bus, an inferlet in
another process (a Ray task) finds the bus, and a shard requeues messages to waiters first. Delivery itself
(push/pull, broadcast) is in ``test_bus.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import ray
from inferlet import messaging
from inferlet.messaging import BusError
from pie_cluster.bus import start_bus
from pie_cluster.bus.topics import Topics
from pie_cluster.hosts.run import run_inferlet
from support.bus_calls import BUS, NOTHING_HELD, ping, puller, pusher, run, wait_for_stats
from support.sdk_host import TRUST

# -- namespacing, errors ------------------------------------------------------------------------------------------


async def alice_writes(input: dict) -> None:
    messaging.push("inbox", "for alice's pullers")
    messaging.broadcast("news", "for alice's subscribers")


async def bob_reads(input: dict) -> list[str]:
    sub = messaging.subscribe("news")
    await input["alice_done"]
    messaging.push("inbox", "bob's own")
    messaging.broadcast("news", "bob's news")
    return [await messaging.pull("inbox"), await sub.next()]


async def pull_inbox(input: dict) -> str:
    return await messaging.pull("inbox")


def test_topics_are_per_user(ray_session, user):
    """On a single shard (every topic shares one connection, so anything leaked from alice would arrive first),
    bob's pull and subscription see only his own messages, and alice's message waits for alice."""
    single = start_bus(1, name="pie-bus-test-single", detached=False, secret=TRUST.secret)
    alice, bob = f"alice-{user}", f"bob-{user}"

    async def scenario():
        alice_done = asyncio.get_running_loop().create_future()
        reader = asyncio.ensure_future(
            run_inferlet(bob_reads, {"alice_done": alice_done}, {}, bob, **TRUST.instance(bob), bus=single.addresses())
        )
        await wait_for_stats(single, bob, subscriptions=1)
        await run_inferlet(alice_writes, {}, {}, alice, **TRUST.instance(alice), bus=single.addresses())
        alice_done.set_result(None)
        pulled = await run_inferlet(pull_inbox, {}, {}, alice, **TRUST.instance(alice), bus=single.addresses())
        return await reader, pulled

    try:
        bobs, alices = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert bobs == ["bob's own", "bob's news"]
        assert alices == "for alice's pullers"
        assert single.stats(alice) == single.stats(bob) == NOTHING_HELD
    finally:
        single.shutdown()


async def misuse(input: dict) -> list[str]:
    errors = []
    for call in (lambda: messaging.push("t", {"not": "a string"}), lambda: messaging.subscribe("")):
        try:
            call()
        except TypeError as e:
            errors.append(str(e))
    return errors


def test_bad_arguments_and_no_bus_are_clear_errors(bus, user):
    (errors,) = run(bus, (misuse, {}), user=user)
    assert "a message is a string, not dict" in errors[0] and "a topic is a non-empty string" in errors[1]
    with pytest.raises(BusError, match="no message bus is configured"):
        asyncio.run(run_inferlet(pusher, {"n": 1}, {}, user, **TRUST.instance(user)))


# -- cleanup ------------------------------------------------------------------------------------------------------


async def holds_then_ends(input: dict) -> None:
    """Hold three subscriptions and two pulls (one in a task left behind), then fail or wait to be stopped."""
    for i in range(3):
        messaging.subscribe(f"s{i}")
    asyncio.ensure_future(messaging.pull("left-behind"))
    await asyncio.sleep(0)
    if input["how"] == "raises":
        raise RuntimeError("inferlet failed")
    await messaging.pull("never")


@pytest.mark.parametrize("how", ["raises", "cancelled", "deadline"])
def test_an_inferlet_that_ends_badly_leaves_nothing_on_the_bus(bus, user, how):
    async def scenario():
        inferlet = run_inferlet(holds_then_ends, {"how": how}, {}, user, **TRUST.instance(user), bus=bus.addresses())
        task = asyncio.ensure_future(inferlet)
        if how == "raises":
            with pytest.raises(RuntimeError, match="inferlet failed"):
                await task
            return
        await wait_for_stats(bus, user, subscriptions=3, waiters=2)
        if how == "cancelled":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(task, 0.05)

    asyncio.run(scenario())
    assert bus.stats(user) == NOTHING_HELD
    # the withdrawn pulls took nothing with them: a message pushed now waits for the next puller
    assert run(bus, (pusher, {"n": 1}), (puller, {"n": 1}), user=user)[1] == [0]


def test_a_killed_host_is_dropped_at_the_next_delivery(bus, user):
    """A host process that dies without saying goodbye: the shard finds out when a delivery to it fails, and drops
    its pulls and subscriptions."""

    @ray.remote(num_cpus=0)
    class Host:
        async def run(self, user, identity, addresses):
            from inferlet import messaging
            from pie_cluster.hosts.run import run_inferlet

            async def holder(input):
                messaging.subscribe("feed")
                await messaging.pull("jobs")

            await run_inferlet(holder, {}, {}, user, **identity, bus=addresses)

    host = Host.remote()
    host.run.remote(user, TRUST.instance(user), bus.addresses())

    async def prober(input: dict) -> str:
        await wait_for_stats(bus, user, subscriptions=1, waiters=1)
        ray.kill(host)
        while bus.stats(user).sessions:
            messaging.broadcast("feed", "anyone there?")
            await asyncio.sleep(0.01)
        messaging.push("jobs", "job")
        return await messaging.pull("jobs")

    assert run(bus, (prober, {}), user=user) == ["job"]
    assert bus.stats(user) == NOTHING_HELD


# -- from another process -----------------------------------------------------------------------------------------


def test_an_inferlet_in_a_ray_task_finds_the_bus_and_plays(bus, user):
    @ray.remote(num_cpus=0)
    def remote_pong(user: str, identity: dict, rounds: int) -> list[str]:
        import asyncio

        from inferlet import messaging
        from pie_cluster.bus import find_bus
        from pie_cluster.hosts.run import run_inferlet

        async def pong(input):
            got = []
            for _ in range(input["rounds"]):
                got.append(await messaging.pull("ping"))
                messaging.push("pong", got[-1])
            return got

        return asyncio.run(run_inferlet(pong, {"rounds": rounds}, {}, user, **identity, bus=find_bus(BUS).addresses()))

    ponged = remote_pong.remote(user, TRUST.instance(user), 100)
    (pinged,) = run(bus, (ping, {"rounds": 100}), user=user)
    assert pinged == ray.get(ponged) == [str(i) for i in range(100)]
    assert bus.stats(user) == NOTHING_HELD


# -- the shard's bookkeeping --------------------------------------------------------------------------------------


def test_requeued_messages_go_to_waiters_first_then_ahead_of_the_queue():
    sent = []
    topics = Topics(lambda peer, user, event: sent.append((peer, event)))
    key = ("u", "t")
    topics.pull(b"a", "u", 1, key)
    topics.requeue(key, ["m1", "m2", "m3"])
    topics.push(key, "m4")
    topics.requeue(key, ["m0"])
    assert sent == [(b"a", ["pulled", 1, "t", "m1"])]
    for rid in range(2, 6):
        topics.pull(b"b", "u", rid, key)
    assert [event[3] for _, event in sent[1:]] == ["m0", "m2", "m3", "m4"]
    assert topics.stats() == NOTHING_HELD
