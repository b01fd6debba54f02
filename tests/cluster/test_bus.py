"""The message bus end to end: inferlets run by the real host against real shard actors on Ray.

push/pull must deliver every message exactly once and in FIFO order, broadcast must reach every subscription open
when it arrives, topics are per user, and an inferlet that ends in any way leaves nothing behind on the bus.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st
from inferlet import messaging
from inferlet.messaging import SUBSCRIPTION_BUFFER, BusError
from pie_cluster.bus import start_bus
from pie_cluster.bus.topics import Topics
from pie_cluster.host import run_inferlet
from sdk_host import TRUST

BUS = "pie-bus-test"
NOTHING_HELD = {"sessions": 0, "topics": 0, "queued": 0, "waiters": 0, "subscriptions": 0}


@pytest.fixture(scope="module")
def bus(ray_session):
    bus = start_bus(2, name=BUS, detached=False, secret=TRUST.secret)
    yield bus
    bus.shutdown()


@pytest.fixture
def user() -> str:
    """A fresh user per test, so tests sharing the bus never share a topic."""
    return f"user-{uuid.uuid4().hex[:8]}"


def run(bus, *mains_inputs, user: str) -> list:
    """Run inferlets concurrently in this process, as a host does; fail rather than hang."""

    async def all_of():
        runs = (
            run_inferlet(main, input, {}, user, **TRUST.instance(user), bus=bus.addresses())
            for main, input in mains_inputs
        )
        return await asyncio.wait_for(asyncio.gather(*runs), 60)

    return asyncio.run(all_of())


async def wait_for_stats(bus, user: str, **expected: int) -> None:
    """Let the event loop run until the bus reports ``expected`` for ``user``."""
    while any(bus.stats(user)[name] != count for name, count in expected.items()):
        await asyncio.sleep(0.01)


# -- push / pull --------------------------------------------------------------------------------------------------


async def ping(input: dict) -> list[str]:
    got = []
    for i in range(input["rounds"]):
        messaging.push("ping", str(i))
        got.append(await messaging.pull("pong"))
    return got


async def pong(input: dict) -> list[str]:
    got = []
    for _ in range(input["rounds"]):
        got.append(await messaging.pull("ping"))
        messaging.push("pong", got[-1])
    return got


def test_two_inferlets_play_ping_pong(bus, user):
    rounds = {"rounds": 200}
    pinged, ponged = run(bus, (ping, rounds), (pong, rounds), user=user)
    assert pinged == ponged == [str(i) for i in range(200)]
    assert bus.stats(user) == NOTHING_HELD


async def pusher(input: dict) -> None:
    for i in range(input["n"]):
        messaging.push("work", str(i))
        if i % 50 == 0:
            await asyncio.sleep(0)


async def puller(input: dict) -> list[int]:
    return [int(await messaging.pull("work")) for _ in range(input["n"])]


def test_competing_pullers_each_message_once_in_order(bus, user):
    """Four inferlets pull one topic while a fifth pushes: the union is every message once, each puller's share is
    in push order."""
    pullers = [(puller, {"n": 100}) for _ in range(4)]
    *shares, _ = run(bus, *pullers, (pusher, {"n": 400}), user=user)
    assert sorted(m for share in shares for m in share) == list(range(400))
    assert all(share == sorted(share) for share in shares)
    assert bus.stats(user) == NOTHING_HELD


async def scripted(input: dict) -> dict:
    """Apply ``ops`` to one topic in order (pushes, pulls in their own tasks, cancellations of those pulls), then
    let every live pull finish and drain what is left; report what each pull and the drain received."""
    pushed = 0
    pulls: list[asyncio.Task] = []
    for op in input["ops"]:
        if op == "push":
            messaging.push("q", str(pushed))
            pushed += 1
        elif op == "pull":
            pulls.append(asyncio.ensure_future(messaging.pull("q")))
        elif op[1] < len(pulls):
            pulls[op[1]].cancel()
        await asyncio.sleep(0)  # the pull task sends its request (or cancellation) now, in op order
    for _ in pulls:
        messaging.push("q", str(pushed))
        pushed += 1
    await asyncio.gather(*pulls, return_exceptions=True)
    results = [None if task.cancelled() else int(task.result()) for task in pulls]
    received = sum(r is not None for r in results)
    drained = [int(await messaging.pull("q")) for _ in range(pushed - received)]
    return {"pushed": pushed, "pulls": results, "drained": drained}


def fifo_model(ops: list) -> tuple[list[int], list[int]]:
    """What a FIFO queue with FIFO waiters hands each pull (no cancellations), and the order the rest drain in."""
    queue, waiters, results, pushed = [], [], [], 0
    for op in [*ops, *["push"] * ops.count("pull")]:
        if op == "push":
            if waiters:
                results[waiters.pop(0)] = pushed
            else:
                queue.append(pushed)
            pushed += 1
        else:
            results.append(None)
            if queue:
                results[-1] = queue.pop(0)
            else:
                waiters.append(len(results) - 1)
    return results, queue


operations = st.lists(st.one_of(st.just("push"), st.just("pull"), st.tuples(st.just("cancel"), st.integers(0, 12))))


@settings(max_examples=30, deadline=None)
@given(ops=operations.filter(lambda ops: len(ops) <= 30))
def test_push_pull_exactly_once_fifo_under_any_interleaving(bus, ops):
    user = f"hyp-{uuid.uuid4().hex[:8]}"
    (got,) = run(bus, (scripted, {"ops": ops}), user=user)
    received = [r for r in got["pulls"] if r is not None] + got["drained"]
    assert sorted(received) == list(range(got["pushed"])), "every message exactly once"
    if all(op in ("push", "pull") for op in ops):  # without cancellations the assignment is fully determined
        assert (got["pulls"], got["drained"]) == fifo_model(ops)
    assert bus.stats(user) == NOTHING_HELD


# -- broadcast / subscribe ----------------------------------------------------------------------------------------


async def swarm_member(input: dict) -> list[str]:
    """Subscribe, meet the others (through push/pull), broadcast ``k`` messages, read everyone's."""
    me, n, k = input["me"], input["n"], input["k"]
    sub = messaging.subscribe("swarm")
    messaging.push("joined", str(me))
    if me == 0:
        for _ in range(n):
            await messaging.pull("joined")
        for _ in range(n):
            messaging.push("go", "")
    await messaging.pull("go")
    for j in range(k):
        messaging.broadcast("swarm", f"{me}:{j}")
    got = []
    async for message in sub:
        got.append(message)
        if len(got) == n * k:
            sub.unsubscribe()
    return got


def test_swarm_of_eight_exchanges_broadcasts(bus, user):
    n, k = 8, 40
    seen = run(bus, *[(swarm_member, {"me": i, "n": n, "k": k}) for i in range(n)], user=user)
    everything = sorted(f"{i}:{j}" for i in range(n) for j in range(k))
    for got in seen:
        assert sorted(got) == everything, "each subscriber gets every broadcast once"
        for i in range(n):
            assert [m for m in got if m.startswith(f"{i}:")] == [f"{i}:{j}" for j in range(k)], "sender order kept"
    assert all(got == seen[0] for got in seen), "one topic lives on one shard: everyone sees the same order"
    assert bus.stats(user) == NOTHING_HELD


async def flooded(input: dict) -> dict:
    """Broadcast past the subscription's buffer without reading, then read what it kept."""
    sub = messaging.subscribe("flood")
    for i in range(input["n"]):
        messaging.broadcast("flood", str(i))
    while sub.dropped < input["n"] - SUBSCRIPTION_BUFFER:  # every broadcast has arrived once this many dropped
        await asyncio.sleep(0.001)
    kept = [await sub.next() for _ in range(SUBSCRIPTION_BUFFER)]
    sub.unsubscribe()
    return {"dropped": sub.dropped, "kept": kept, "after": await sub.next()}


def test_subscription_overflow_drops_the_oldest(bus, user):
    (got,) = run(bus, (flooded, {"n": SUBSCRIPTION_BUFFER + 100}), user=user)
    assert got["dropped"] == 100
    assert got["kept"] == [str(i) for i in range(100, SUBSCRIPTION_BUFFER + 100)]
    assert got["after"] is None


async def late_subscriber(input: dict) -> dict:
    early = messaging.subscribe("news")
    messaging.broadcast("news", "before")
    late = messaging.subscribe("news")
    messaging.broadcast("news", "after")
    first = [await early.next(), await early.next(), await late.next()]
    early.unsubscribe()
    messaging.broadcast("news", "ignored by early")
    rest = [message async for message in _until_unsubscribed(late, after=1)]
    return {"first": first, "early_after_unsubscribe": await early.next(), "late_rest": rest}


async def _until_unsubscribed(sub, after: int):
    """Iterate ``sub`` with ``async for`` and unsubscribe once ``after`` messages came: the loop then ends."""
    count = 0
    async for message in sub:
        yield message
        count += 1
        if count == after:
            sub.unsubscribe()


def test_subscription_sees_only_later_broadcasts_and_ends_on_unsubscribe(bus, user):
    (got,) = run(bus, (late_subscriber, {}), user=user)
    assert got == {
        "first": ["before", "after", "after"],
        "early_after_unsubscribe": None,
        "late_rest": ["ignored by early"],
    }
    assert bus.stats(user) == NOTHING_HELD


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
            from pie_cluster.host import run_inferlet

            async def holder(input):
                messaging.subscribe("feed")
                await messaging.pull("jobs")

            await run_inferlet(holder, {}, {}, user, **identity, bus=addresses)

    host = Host.remote()
    host.run.remote(user, TRUST.instance(user), bus.addresses())

    async def prober(input: dict) -> str:
        await wait_for_stats(bus, user, subscriptions=1, waiters=1)
        ray.kill(host)
        while bus.stats(user)["sessions"]:
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
        from pie_cluster.host import run_inferlet

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
