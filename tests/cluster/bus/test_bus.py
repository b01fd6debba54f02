"""The message bus end to end: inferlets run by the real host against real shard actors on Ray.

push/pull must deliver every message exactly once and in FIFO order, under any interleaving, and broadcast must
reach every subscription open when it arrives. That topics are per user, errors, and that an inferlet ending in any
way leaves nothing behind on the bus are in ``test_bus_isolation.py``.
"""

from __future__ import annotations

import asyncio
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st
from inferlet import messaging
from inferlet.messaging import SUBSCRIPTION_BUFFER
from support.bus_calls import NOTHING_HELD, ping, pong, puller, pusher, run

# -- push / pull --------------------------------------------------------------------------------------------------


def test_two_inferlets_play_ping_pong(bus, user):
    rounds = {"rounds": 200}
    pinged, ponged = run(bus, (ping, rounds), (pong, rounds), user=user)
    assert pinged == ponged == [str(i) for i in range(200)]
    assert bus.stats(user) == NOTHING_HELD


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
