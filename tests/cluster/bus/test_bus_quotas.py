"""What a bus shard lets each user put on it (``[limits]``, ``bus/quotas.py``), on real shards with inferlets that use
only the SDK: alice goes past the message size, her queued bytes and the shard's journal bound, and gets a
``QuotaExceeded`` naming the limit in her inferlet; bob's messages queued on the same shard all arrive, and the
journal on the node's disk stays within its bound however much goes through it. A raw peer with no capability is
refused, and one that sends a message past the shard's size bound is dropped before it is read."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import msgpack
import pytest
import zmq
from inferlet import QuotaExceeded, messaging
from pie_cluster.bus import start_bus
from pie_cluster.bus.shard import MAX_MESSAGE_BYTES
from pie_cluster.limits import BusLimits
from support.bus_calls import run
from support.sdk_host import TRUST

KIB = 1 << 10
MIB = 1 << 20


def one_shard(name: str, limits: BusLimits):
    bus = start_bus(1, name=f"pie-bus-test-{name}-{uuid.uuid4().hex[:6]}", detached=False, secret=TRUST.secret,
                    limits=limits)  # fmt: skip
    return bus


@pytest.fixture(scope="module")
def default_bus(ray_session):
    """One shard with the default limits: alice and bob share it."""
    bus = one_shard("defaults", BusLimits())
    yield bus
    bus.shutdown()


@pytest.fixture(scope="module")
def tight_bus(ray_session):
    bus = one_shard("tight", BusLimits(message_bytes=256 * KIB, queued_bytes_per_user=MIB, journal_bytes=64 * MIB))
    yield bus
    bus.shutdown()


@pytest.fixture(scope="module")
def small_journal(ray_session):
    bus = one_shard("journal", BusLimits(message_bytes=256 * KIB, journal_bytes=2 * MIB))
    yield bus
    bus.shutdown()


async def push_then_confirm(input: dict) -> list[str]:
    """Push each of ``sizes`` on ``topic``; then one round trip (a subscription), after which a refusal of any of
    them is what the next call raises. Returns what was raised, if anything."""
    for size in input["sizes"]:
        messaging.push(input["topic"], "x" * size)
    messaging.subscribe("confirm").unsubscribe()
    try:
        messaging.push(input["topic"], "after")
    except QuotaExceeded as e:
        return [str(e)]
    return []


async def pull_n(input: dict) -> list[int]:
    return [len(await messaging.pull(input["topic"])) for _ in range(input["n"])]


def test_a_128_mib_push_is_refused_and_bobs_queued_message_still_arrives(default_bus):
    alice, bob = f"alice-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    run(default_bus, (push_then_confirm, {"topic": "jobs", "sizes": [10]}), user=bob)  # queued for later

    [refused] = run(default_bus, (push_then_confirm, {"topic": "jobs", "sizes": [128 * MIB]}), user=alice)
    assert refused == [
        f"the message bus refused a message: a message of {128 * MIB} bytes is over this cluster's limit: [limits] "
        f"bus_message_bytes = {16 * MIB}"
    ]
    assert default_bus.stats(alice).queued == 0  # nothing of it (and the push after it raised, unsent)

    async def big_then_end(input):
        messaging.push("jobs", "y" * (128 * MIB))  # and nothing after: the refusal ends the inferlet

    with pytest.raises(QuotaExceeded, match="bus_message_bytes"):
        run(default_bus, (big_then_end, {}), user=alice)
    assert run(default_bus, (pull_n, {"topic": "jobs", "n": 2}), user=bob) == [[10, 5]]  # "x" * 10, then "after"


def test_bytes_queued_past_the_users_bound_are_refused_not_bobs(tight_bus):
    alice, bob = f"alice-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    quarter = 256 * KIB
    [refused] = run(tight_bus, (push_then_confirm, {"topic": "t", "sizes": [quarter] * 5}), user=alice)
    assert len(refused) == 1 and f"[limits] bus_queued_bytes_per_user = {MIB}" in refused[0]
    assert tight_bus.stats(alice).queued == 4  # the four that fit (the last push, "after", was refused too)

    [bobs] = run(tight_bus, (push_then_confirm, {"topic": "t", "sizes": [quarter - 8] * 4}), user=bob)
    assert bobs == []  # alice's queue counts against alice alone
    assert run(tight_bus, (pull_n, {"topic": "t", "n": 5}), user=bob) == [[quarter - 8] * 4 + [5]]
    assert run(tight_bus, (pull_n, {"topic": "t", "n": 4}), user=alice) == [[quarter] * 4]


def test_the_journal_stays_within_its_bound_and_full_queues_refuse_pushes(small_journal):
    alice = f"alice-{uuid.uuid4().hex[:6]}"
    journal = Path(f"{Path(small_journal.infos[0].ipc.removeprefix('ipc://')).parent}.journal")

    async def churn(input):
        """8 MiB through the journal, never more than 512 KiB of it queued."""
        for _ in range(16):
            for _ in range(2):
                messaging.push("churn", "z" * (250 * KIB))
            for _ in range(2):
                await messaging.pull("churn")
        return os.path.getsize(journal)

    sizes = run(small_journal, (churn, {}), user=alice)
    assert max(sizes[0], os.path.getsize(journal)) <= 2 * MIB

    others = [f"user-{uuid.uuid4().hex[:6]}" for _ in range(5)]
    refusals = [
        run(small_journal, (push_then_confirm, {"topic": "t", "sizes": [250 * KIB] * 3}), user=u)[0] for u in others
    ]
    # the shard's queues are held to half the journal's bound (1 MiB): four messages of 250 KB, every user's
    assert sum(not r for r in refusals) == 1 and all("bus_journal_bytes" in r[0] for r in refusals[1:])
    assert os.path.getsize(journal) <= 2 * MIB
    for user in others:  # what was queued is all there
        queued = small_journal.stats(user).queued
        if queued:
            assert run(small_journal, (pull_n, {"topic": "t", "n": queued}), user=user)[0][:1] == [250 * KIB]


def test_a_journal_rewritten_to_stay_within_its_bound_reads_back_the_same_queues(tmp_path):
    """The bound's rewrites happen between a burst's changes (before its write): what a restart reads back is still
    exactly what was queued, and the file never grew past the bound."""
    from collections import OrderedDict

    from pie_cluster.bus.journal import Journal, Replayed
    from pie_cluster.bus.topics import Topics

    path, bound = tmp_path / "shard.journal", 64 * KIB
    journal = Journal(path, bound)
    topics = Topics(lambda peer, user, event: None, journal, journal.replay().queues)
    state = lambda: Replayed(topics.queued_messages(), OrderedDict())  # noqa: E731
    largest = 0
    for i in range(200):
        topics.push(("alice", "t"), f"{i:04d}" + "m" * 1000)
        journal.bound(state)
        if i % 10:  # a tenth stays queued: 20 KB at the end, within half the bound (what ``quotas.py`` keeps)
            topics.pull(b"bob/1", "alice", i, ("alice", "t"))
        journal.flush(state)
        largest = max(largest, os.path.getsize(path))
    assert largest <= bound
    again = Topics(lambda peer, user, event: None, None, Journal(path).replay().queues)
    assert again.queued_messages() == topics.queued_messages()
    assert again.queued_bytes("alice") == topics.queued_bytes("alice") == 20 * 1004


def _answer(dealer, wait_ms: int) -> list | None:
    """The events of the shard's next frame to this raw peer, or None if none came within ``wait_ms``."""
    if not dealer.poll(wait_ms):
        return None
    return msgpack.unpackb(dealer.recv_multipart()[-1])


def test_a_peer_without_a_capability_is_refused_and_one_past_the_size_bound_is_dropped_unread(default_bus):
    """Before any capability: a small frame is answered with a refusal; a message past the shard's ZeroMQ size bound
    disconnects its peer as soon as its length is read (no answer, nothing allocated for it); bob is served on."""
    context = zmq.Context.instance()
    address = default_bus.addresses()[0]
    stranger, flooder = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    for peer, name in ((stranger, b"someone/1"), (flooder, b"someone/2")):
        peer.setsockopt(zmq.IDENTITY, name)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(address)
    try:
        stranger.send_multipart([b"not a capability", msgpack.packb([["cast", "t", "hi"]])])
        [refused] = _answer(stranger, 10_000)
        assert refused[0] == "refused" and "malformed capability" in refused[1], refused

        flooder.send_multipart([b"x" * (MAX_MESSAGE_BYTES + 1)])
        assert _answer(flooder, 2_000) is None  # never read, so never answered: the shard dropped the connection
        bob = f"bob-{uuid.uuid4().hex[:6]}"
        run(default_bus, (push_then_confirm, {"topic": "after-flood", "sizes": [3]}), user=bob)
        assert run(default_bus, (pull_n, {"topic": "after-flood", "n": 2}), user=bob) == [[3, 5]]
    finally:
        stranger.close()
        flooder.close()
