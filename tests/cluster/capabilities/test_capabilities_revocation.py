"""Capabilities end with their instance, and name only what it was given, on a real replica (a Ray actor serving
the tiny model, named "default" in the cluster's directory) and a real bus shard: a capability whose ``models``
grant leaves this model out is refused at the handshake; when alice's instance ends, the trusted side's revocation
(``pie_cluster.hosts.revocations.Revoker``, as the node hosts and the ingress send it) closes her lingering raw
connection to the replica, refuses her capability on both from then on and drops what she held on the bus, while bob's
inferlet on the same replica and bus runs on with the tokens it makes unloaded. An instance holds a bounded number of
peers on a bus shard (replica connections: ``tests/engine/test_channel_handshake.py``)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import ray
from inferlet import Context, Model, Sampler, messaging
from pie_cluster.bus import start_bus
from pie_cluster.hosts.revocations import Revoker
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_workers.wire.capability import mint
from support.forgery import SECRET
from support.sdk_host import TRUST
from test_capabilities_bus import dealer, events
from test_capabilities_replica import Raw, session, stats


@pytest.fixture(scope="module")
def replica(ray_session, tiny_llama):
    """The tiny model's replica, named "default" in a user directory of its own (so it knows its model's name)."""
    import uuid

    from pie_cluster.stores.directory import get_or_create_directory
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings

    directory = get_or_create_directory(f"pie-test-revocation-{uuid.uuid4().hex[:8]}")
    settings = RunnerSettings(num_pages=64)
    replica = Replica(
        tiny_llama, 1, settings, cpus_per_rank=1, engine=BatchLimits(), secret=SECRET, directory=(directory, "default")
    )
    yield replica
    replica.shutdown()
    ray.kill(directory)


@pytest.fixture(scope="module")
def bus(ray_session):
    bus = start_bus(1, name="pie-bus-revocation", detached=False, secret=SECRET)
    yield bus
    bus.shutdown()


async def bobs_story(input) -> list[int]:
    """Greedy tokens, with a pause half way (while alice's instance ends), and a message to the bus after it."""
    ctx = Context(Model.load("default"))
    ctx.user("once upon a time").cue()
    tokens = await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
    await asyncio.sleep(input["pause_s"])
    tokens += await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
    messaging.push("bob-notes", "still here")
    return tokens


def test_a_capability_not_granted_this_model_is_refused(replica):
    for models, refused in [(("other-model",), True), (("other-model", "default"), False), (None, False)]:
        capability = mint(SECRET, "alice", "granted", 60, models=models)
        raw = Raw(replica.addresses["ipc"], capability)
        error, message = raw.call(session(capability), "stats")
        if refused:
            assert error == "PermissionError" and "does not grant model 'default'" in message and raw.hung_up()
        else:
            assert error is None, message
        raw.close()


def test_an_ended_instances_capability_is_refused_and_its_connections_dropped(replica, bus):
    alice = TRUST.instance("alice")
    bob = TRUST.instance("bob")
    endpoints = endpoints_for("default", replica)
    unloaded = asyncio.run(run_inferlet(bobs_story, {"pause_s": 0}, endpoints, "bob", **TRUST.instance("bob"),
                                        bus=bus.addresses()))  # fmt: skip
    before = stats(replica).contexts

    # alice's instance holds a context on the replica and a pull on the bus, and a raw connection it never closes
    lingering = Raw(replica.addresses["ipc"], alice["capability"])
    assert lingering.call(session(alice["capability"]), "create")[0] is None
    shard = bus.infos[0].ipc
    pulling = dealer(shard, f"{alice['instance_id']}/s".encode())
    pulling.send_multipart([alice["capability"].encode(), msgpack.packb([["pull", "inbox", 1]])])
    for _ in range(200):
        if bus.stats("alice").waiters == 1:
            break
        time.sleep(0.05)
    assert stats(replica).contexts == before + 1 and bus.stats("alice").waiters == 1

    async def alice_ends_while_bob_runs():
        bobs = asyncio.ensure_future(
            run_inferlet(bobs_story, {"pause_s": 1.0}, endpoints, "bob", **bob, bus=bus.addresses())
        )
        revoker = Revoker(lambda: (replica.leader, *bus.shards))  # what a host does with the capabilities it mints
        revoker.minted(alice["instance_id"], 3600)
        await asyncio.sleep(0.3)
        revoker.ended([alice["instance_id"]])
        return await bobs

    assert asyncio.run(alice_ends_while_bob_runs()) == unloaded, "bob's tokens, on the replica alice's instance left"

    revoked = f"revoked capability: instance {alice['instance_id']!r} has ended"
    assert lingering.replies() == [[None, "RevokedError", revoked]] and lingering.hung_up()
    lingering.close()
    assert events(pulling) == [["refused", revoked]]
    pulling.send_multipart([alice["capability"].encode(), msgpack.packb([["pull", "inbox", 2]])])
    assert events(pulling) == [["refused", revoked]]
    pulling.close()
    again = Raw(replica.addresses["tcp"], alice["capability"])
    error, message = again.call(session(alice["capability"], "another"), "create")
    assert error == "PermissionError" and message == revoked and again.hung_up()
    again.close()
    for _ in range(200):  # her context is released as if her connection had dropped
        if stats(replica).contexts == before:
            break
        time.sleep(0.05)
    assert stats(replica).contexts == before
    assert bus.stats("alice").waiters == 0 and bus.stats("bob").queued == 2


def test_bus_peers_past_the_per_instance_bound_are_refused_naming_the_limit(bus):
    alice = TRUST.instance("alice")
    token = alice["capability"].encode()
    shard = bus.infos[0].ipc
    peers = []
    for i in range(16):  # ``[limits] connections_per_instance``'s default
        sock = dealer(shard, f"{alice['instance_id']}/s{i}".encode())
        sock.send_multipart([token, msgpack.packb([["sub", "news", i]])])
        assert events(sock) == [["ok", i]]
        peers.append(sock)
    extra = dealer(shard, f"{alice['instance_id']}/one-too-many".encode())
    extra.send_multipart([token, msgpack.packb([["sub", "news", 99]])])
    [[kind, why]] = events(extra)
    assert kind == "refused" and "connections_per_instance = 16" in why, why
    bob = TRUST.instance("bob")  # another user's instance is not crowded out
    theirs = dealer(shard, f"{bob['instance_id']}/s".encode())
    theirs.send_multipart([bob["capability"].encode(), msgpack.packb([["sub", "news", 1]])])
    assert events(theirs) == [["ok", 1]]
    peers[0].send_multipart([token, msgpack.packb([["close", 7]])])  # one leaves: room for one more
    assert events(peers[0]) == [["ok", 7]]
    extra.send_multipart([token, msgpack.packb([["sub", "news", 100]])])
    assert events(extra) == [["ok", 100]]
    for sock, capability in [*((sock, token) for sock in [*peers[1:], extra]), (theirs, bob["capability"].encode())]:
        sock.send_multipart([capability, msgpack.packb([["close", 0]])])
        assert events(sock) == [["ok", 0]]
        sock.close()
    peers[0].close()
    assert bus.stats("alice").subscriptions == bus.stats("bob").subscriptions == 0


def test_a_bus_shard_started_after_an_instance_ended_refuses_it_from_its_minters_next_standing(ray_session):
    """Revocations live in the targets' memory: a shard that starts after alice's instance ended (a restart, or
    one the ending never reached) has not heard of it. The minter's next standing tells it: from then on her
    capability is refused and the pull she holds there is dropped, while bob's goes on."""
    from pie_workers.wire.admission import STANDING_S

    shards: list = []

    async def story() -> None:
        revoker = Revoker(lambda: tuple(shards))
        capability = {}
        for user in ("alice", "bob"):
            instance = f"{user}-late"
            capability[user] = mint(SECRET, user, instance, 3600, minting=revoker.minted(instance, 3600))
        revoker.ended(["alice-late"])  # told to no shard: none runs yet
        await asyncio.sleep(0.1)
        late = await asyncio.to_thread(start_bus, 1, name="pie-bus-late", detached=False, secret=SECRET)
        shards.extend(late.shards)
        try:
            address = late.infos[0].ipc
            pulling = {user: dealer(address, f"{user}-late/s".encode()) for user in capability}
            for user, sock in pulling.items():
                sock.send_multipart([capability[user].encode(), msgpack.packb([["pull", "inbox", 1]])])
            for _ in range(100):
                if late.stats("alice").waiters == late.stats("bob").waiters == 1:
                    break
                await asyncio.sleep(0.05)
            assert late.stats("alice").waiters == 1  # not yet known to have ended
            revoked = "revoked capability: instance 'alice-late' has ended"
            assert await asyncio.to_thread(events, pulling["alice"], STANDING_S + 5) == [["refused", revoked]]
            assert late.stats("alice").waiters == 0 and late.stats("bob").waiters == 1
            pulling["alice"].send_multipart([capability["alice"].encode(), msgpack.packb([["pull", "inbox", 2]])])
            assert await asyncio.to_thread(events, pulling["alice"]) == [["refused", revoked]]
            for sock in pulling.values():
                sock.close()
        finally:
            late.shutdown()

    asyncio.run(story())
