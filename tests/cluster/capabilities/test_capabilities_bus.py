"""Capabilities on the message bus, attacked through a raw ZeroMQ DEALER: nobody but bob pulls bob's queue, an
inferlet the bus refuses fails with a clear error instead of hanging, and a running bus under another secret is not
taken for ours. The token itself is fuzzed in ``test_capabilities.py``.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
from inferlet import messaging
from inferlet.messaging import BusError
from pie_cluster.bus import start_bus
from pie_cluster.hosts.run import run_inferlet
from pie_workers.wire.capability import mint
from support.bus_calls import NOTHING_HELD
from support.forgery import SECRET, expired, forged
from support.sdk_host import TRUST

# -- the message bus ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bus(ray_session):
    bus = start_bus(1, name="pie-bus-capabilities", detached=False, secret=SECRET)
    yield bus
    bus.shutdown()


def dealer(address: str, routing_id: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def events(sock: zmq.Socket, timeout_s: float = 10.0) -> list:
    """The next frame of events from the shard (empty if none comes)."""
    return msgpack.unpackb(sock.recv()) if sock.poll(int(timeout_s * 1000)) else []


async def pushes(input):
    messaging.push("inbox", "for bob only")


async def pulls(input):
    return await messaging.pull("inbox")


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_nobody_but_bob_pulls_bobs_queue(bus, transport):
    asyncio.run(run_inferlet(pushes, {}, {}, "bob", **TRUST.instance("bob"), bus=bus.addresses()))
    assert bus.stats("bob").queued == 1
    address = getattr(bus.infos[0], transport)
    bob, alice = TRUST.instance("bob"), TRUST.instance("alice")
    pull = msgpack.packb([["pull", "inbox", 1]])
    attempts = [  # (routing id, the message's parts, why it is refused)
        (f"{bob['instance_id']}/s/bob", [pull], "no capability was presented"),  # the old protocol: a name only
        (f"{bob['instance_id']}/s", [forged(alice["capability"], user="bob").encode(), pull], "bad capability"),
        (f"{bob['instance_id']}/s", [alice["capability"].encode(), pull], "is not one of instance"),
        (f"{bob['instance_id']}/s", [mint(b"not ours", "bob", bob["instance_id"], 60).encode(), pull], "bad capab"),
        (f"{bob['instance_id']}/s", [expired("bob", bob["instance_id"]).encode(), pull], "expired capability"),
    ]
    for i, (routing_id, parts, why) in enumerate(attempts):
        sock = dealer(address, f"{routing_id}{i}".encode())  # the shard may not have noticed the last one left
        sock.send_multipart(parts)
        [[kind, message]] = events(sock)
        assert kind == "refused" and why in message, message
        sock.close()

    sock = dealer(address, f"{alice['instance_id']}/s".encode())  # alice as herself: her own, empty, inbox
    sock.send_multipart([alice["capability"].encode(), pull])
    assert events(sock, 0.5) == []
    assert bus.stats("alice").waiters == 1 and bus.stats("bob").queued == 1
    sock.send_multipart([alice["capability"].encode(), msgpack.packb([["close", 2]])])
    assert events(sock) == [["ok", 2]]
    sock.close()

    got = asyncio.run(run_inferlet(pulls, {}, {}, "bob", **TRUST.instance("bob"), bus=bus.addresses()))
    assert got == "for bob only"
    assert bus.stats("bob") == bus.stats("alice") == NOTHING_HELD


def test_an_inferlet_the_bus_refuses_fails_with_a_clear_error_instead_of_hanging(bus):
    async def uses_the_bus(input):
        errors = []
        for call in (lambda: messaging.subscribe("news"), lambda: messaging.push("jobs", "x")):
            try:
                call()
            except BusError as e:
                errors.append(str(e))
        return errors

    async def waits(input):
        return await messaging.pull("jobs")

    refused = [
        (expired("bob", "i"), "expired capability"),
        (forged(mint(SECRET, "a", "i", 60), user="bob"), "bad capability signature"),
    ]
    for capability, why in refused:
        identity = {"instance_id": "i", "capability": capability}
        errors = asyncio.run(run_inferlet(uses_the_bus, {}, {}, "bob", **identity, bus=bus.addresses()))
        assert len(errors) == 2 and all("refused this inferlet" in e and why in e for e in errors), errors
        with pytest.raises(BusError, match=why):
            asyncio.run(asyncio.wait_for(run_inferlet(waits, {}, {}, "bob", **identity, bus=bus.addresses()), 30))
    assert bus.stats("bob") == NOTHING_HELD


def test_a_running_bus_under_another_secret_is_not_taken_for_ours(bus):
    with pytest.raises(ValueError, match="another cluster secret"):
        start_bus(1, name="pie-bus-capabilities", detached=False, secret=b"some other cluster's secret")
