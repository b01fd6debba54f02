"""A bus shard that dies is restarted by Ray at the addresses it had, with the messages that were queued on it (read
back from its journal); the inferlets whose pulls and subscriptions waited on it are told so instead of waiting
forever: those fail with a ``BusError``. Their connections reconnect by themselves, and the restarted shard serves
them."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
import zlib

import ray
from inferlet import _bus_socket, messaging
from pie_cluster.bus import start_bus
from pie_cluster.hosts.run import move_bus, run_inferlet
from ray.util.state import list_actors
from support.bus_calls import BUS, NOTHING_HELD, wait_for_stats
from support.sdk_host import TRUST


def alive(name: str) -> list[dict]:
    return list_actors(filters=[("name", "=", name), ("state", "=", "ALIVE")])


def same_shard_topics(user: str, shards: int = 2) -> tuple[int, str, str]:
    """A shard and two topics of ``user`` that live on it."""
    by_shard: dict[int, list[str]] = {}
    for i in itertools.count():
        topic = f"topic-{i}"
        found = by_shard.setdefault(zlib.crc32(f"{user}\0{topic}".encode()) % shards, [])
        found.append(topic)
        if len(found) == 2:
            return zlib.crc32(f"{user}\0{topic}".encode()) % shards, *found


def test_a_killed_shard_fails_what_waited_on_it_and_serves_again_at_its_address(bus, user):
    shard, queue, news = same_shard_topics(user)
    (actor,) = list_actors(filters=[("name", "=", f"{BUS}-{shard}"), ("state", "=", "ALIVE")])
    waiting = asyncio.Event()

    async def waiter(input):
        subscription = messaging.subscribe(news)
        pulled = asyncio.ensure_future(messaging.pull(queue))
        waiting.set()
        errors, started = [], time.monotonic()
        for wait in (pulled, subscription.next()):
            try:
                await wait
            except messaging.BusError as e:
                errors.append(str(e))
        messaging.push(queue, "after the restart")  # through the reconnected socket, to the restarted shard
        after = await messaging.pull(queue)
        print(f"the restarted shard delivered a message {time.monotonic() - started:.1f} s after the SIGKILL")
        return errors, after

    async def main():
        running = asyncio.ensure_future(run_inferlet(waiter, {}, {}, user, **TRUST.instance(user), bus=bus.addresses()))
        await waiting.wait()
        await wait_for_stats(bus, user, waiters=1, subscriptions=1)
        os.kill(actor["pid"], signal.SIGKILL)
        return await asyncio.wait_for(running, 60)

    errors, after = asyncio.run(main())
    assert len(errors) == 2 and all("went away" in e and "was lost" in e for e in errors), errors
    assert after == "after the restart"
    (restarted,) = list_actors(filters=[("name", "=", f"{BUS}-{shard}"), ("state", "=", "ALIVE")])
    assert restarted["pid"] != actor["pid"]
    assert ray.get(bus.shards[shard].start.remote()) == bus.infos[shard]  # the same addresses
    assert bus.stats(user) == NOTHING_HELD


def test_messages_queued_on_a_killed_shard_are_pulled_from_its_restart_in_order(bus, user):
    shard, queue, _ = same_shard_topics(user)
    (actor,) = list_actors(filters=[("name", "=", f"{BUS}-{shard}"), ("state", "=", "ALIVE")])
    sent = [f"message {i}" for i in range(5)]

    async def pusher(input):
        for message in sent:
            messaging.push(queue, message)
        first = await messaging.pull(queue)  # one pulled before the kill stays pulled
        return first

    async def puller(input):
        return [await messaging.pull(queue) for _ in range(len(sent) - 1)]

    async def main():
        first = await run_inferlet(pusher, {}, {}, user, **TRUST.instance(user), bus=bus.addresses())
        await wait_for_stats(bus, user, queued=len(sent) - 1)
        os.kill(actor["pid"], signal.SIGKILL)
        while not [a for a in alive(f"{BUS}-{shard}") if a["pid"] != actor["pid"]]:
            await asyncio.sleep(0.05)
        await asyncio.wait_for(wait_for_stats(bus, user, queued=len(sent) - 1), 60)  # by the restarted shard
        rest = await asyncio.wait_for(
            run_inferlet(puller, {}, {}, user, **TRUST.instance(user), bus=bus.addresses()), 60
        )
        return first, rest

    first, rest = asyncio.run(main())
    assert [first, *rest] == sent
    (restarted,) = list_actors(filters=[("name", "=", f"{BUS}-{shard}"), ("state", "=", "ALIVE")])
    assert restarted["pid"] != actor["pid"]
    assert bus.stats(user).queued == 0


def test_messages_pushed_while_a_shard_is_killed_are_each_queued_once_in_order(bus, user):
    """The pusher keeps pushing through the kill: what the dead process had not journaled (still in its socket, or
    read but not applied) is sent again to its restart, which ignores what it already had."""
    shard, queue, _ = same_shard_topics(user)
    (actor,) = list_actors(filters=[("name", "=", f"{BUS}-{shard}"), ("state", "=", "ALIVE")])
    killed = asyncio.Event()

    async def pusher(input):
        pushed = 0
        while not killed.is_set():
            for _ in range(20):
                messaging.push(queue, str(pushed))
                pushed += 1
            await asyncio.sleep(0)
        for _ in range(500):  # and on, while the shard restarts
            messaging.push(queue, str(pushed))
            pushed += 1
        return pushed  # ending waits until the bus confirmed every push

    async def puller(input):
        return [int(await messaging.pull(queue)) for _ in range(input["n"])]

    async def main():
        running = asyncio.ensure_future(run_inferlet(pusher, {}, {}, user, **TRUST.instance(user), bus=bus.addresses()))
        while bus.stats(user).queued < 2000:
            await asyncio.sleep(0.001)
        os.kill(actor["pid"], signal.SIGKILL)
        killed.set()
        pushed = await asyncio.wait_for(running, 60)
        pulled = await asyncio.wait_for(
            run_inferlet(puller, {"n": pushed}, {}, user, **TRUST.instance(user), bus=bus.addresses()), 60
        )
        return pushed, pulled

    pushed, pulled = asyncio.run(main())
    assert pulled == list(range(pushed))
    assert bus.stats(user).queued == 0


def test_a_shard_that_does_not_come_back_fails_calls_on_its_topics_instead_of_hanging(ray_session, user, monkeypatch):
    """A shard killed for good (as when its node is lost): the waiting pull fails at once, a pull made afterwards
    fails once the shard has been unreachable for ``UNREACHABLE_S``, and every later call on it fails at once."""
    monkeypatch.setattr(_bus_socket, "UNREACHABLE_S", 1.0)
    lost = start_bus(1, name="pie-bus-test-lost", detached=False, secret=TRUST.secret)
    waiting = asyncio.Event()

    async def waiter(input):
        errors = []
        pulled = asyncio.ensure_future(messaging.pull("jobs"))
        waiting.set()
        for attempt in (lambda: pulled, lambda: asyncio.wait_for(messaging.pull("jobs"), 30)):
            try:
                await attempt()
            except messaging.BusError as e:
                errors.append(str(e))
        try:
            messaging.push("jobs", "x")
        except messaging.BusError as e:
            errors.append(str(e))
        return errors

    async def main():
        instance = TRUST.instance(user)
        running = asyncio.ensure_future(run_inferlet(waiter, {}, {}, user, **instance, bus=lost.addresses()))
        await waiting.wait()
        await wait_for_stats(lost, user, waiters=1)
        ray.kill(lost.shards[0], no_restart=True)
        return await asyncio.wait_for(running, 60)

    errors = asyncio.run(main())
    assert len(errors) == 3, errors
    assert "went away" in errors[0]
    assert all("has not been reachable for 1 s" in e for e in errors[1:]), errors


def test_an_inferlet_running_in_this_process_follows_its_shard_to_new_addresses(bus, user):
    """What a host with the sandbox off does when the controller made a lost node's shard again elsewhere
    (``host.move_bus``): the running inferlet's socket connects to the new address, and what it pushes from then on
    is queued there."""
    elsewhere = start_bus(1, name="pie-bus-test-elsewhere", detached=False, secret=TRUST.secret)
    connected, moved, pushed, go = (asyncio.Event() for _ in range(4))

    async def mover(input):
        messaging.push("jobs", "before")  # through the first bus
        assert await messaging.pull("jobs") == "before"
        connected.set()
        await moved.wait()
        messaging.push("jobs", "after")
        pushed.set()
        await go.wait()
        return await messaging.pull("jobs")

    async def main():
        running = asyncio.ensure_future(run_inferlet(mover, {}, {}, user, **TRUST.instance(user), bus=bus.addresses()))
        await connected.wait()
        move_bus(elsewhere.addresses() * len(bus.shards))  # every shard of the first bus now listens there
        moved.set()
        await pushed.wait()
        await asyncio.wait_for(wait_for_stats(elsewhere, user, queued=1), 30)
        queued_before = bus.stats(user).queued
        go.set()
        return queued_before, await asyncio.wait_for(running, 60)

    try:
        assert asyncio.run(main()) == (0, "after")
        assert elsewhere.stats(user) == NOTHING_HELD and bus.stats(user) == NOTHING_HELD
    finally:
        elsewhere.shutdown()
