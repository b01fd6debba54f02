"""Identity before anything else, on a real replica engine's channel (the tiny model's runner, real Unix sockets):
alice floods it, connects without a handshake, holds connections open unverified and opens more than her bound,
while bob's inferlet runs forward passes on the same replica. Alice's connections are refused with a reason and
closed, having been read no further than a handshake's room, and nothing of that is logged with a traceback; bob's
passes all complete with the tokens they have unloaded."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import msgpack
import pytest
from inferlet._channel import Channel
from pie_workers.engine.channel import HANDSHAKE_BYTES
from pie_workers.engine.service import ReplicaEngine
from pie_workers.engine.tenancy import TenantLimits
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.admission import ConnectionLimits
from pie_workers.wire.messages import PassReply, PassRequest, decode, encode
from support.engine_harness import SAMPLER, serving
from support.sdk_host import TRUST

LIMITS = ConnectionLimits(per_instance=4, per_user=8, waiting_per_peer=4, handshake_s=1.0)
STEPS = 12


@pytest.fixture(scope="module")
def replica(tiny_llama):
    """The engine serving its channel on a loop in a background thread, with small connection limits."""
    tenants = TenantLimits(connections=LIMITS)
    return serving(
        lambda: ReplicaEngine(
            ModelRunner(tiny_llama, RunnerSettings(num_pages=64)), secret=TRUST.secret, tenants=tenants
        )
    )


def connect(path: str) -> socket.socket:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(path)
    raw.settimeout(30)
    return raw


def hello(capability: str) -> bytes:
    return msgpack.packb(["hello", capability])


def last_words(raw: socket.socket) -> list:
    """Every reply until the replica hangs up."""
    unpacker = msgpack.Unpacker()
    try:
        while data := raw.recv(1 << 16):
            unpacker.feed(data)
    except ConnectionResetError:
        pass
    return [reply for frame in unpacker for reply in frame]


def refusal(raw: socket.socket) -> str:
    """The reason the replica gave for closing the connection (it must have closed it)."""
    (why,) = [value for rid, error, value in last_words(raw) if rid is None and error == "PermissionError"]
    return why


async def generate(path: str, user: str) -> list[int]:
    """Bob's inferlet: a prompt, then ``STEPS`` passes of one token each, through the SDK's channel."""
    channel = Channel(f"ipc://{path}", f"{TRUST.instance(user, 'bobs-run')['capability']}/s")
    try:
        ctx = await asyncio.wait_for(channel.call("create"), 60)
        tokens, position = [5, 6, 7, 8], 0
        out: list[int] = []
        for _ in range(STEPS):
            rows = list(range(position, position + len(tokens)))
            request = PassRequest(ctx, tokens=tokens, positions=rows, slots=[[len(tokens) - 1, SAMPLER]])
            reply = decode(PassReply, await asyncio.wait_for(channel.call("forward", encode(request)), 60))
            position += len(tokens)
            tokens = [reply.slots[0][1]]
            out.append(tokens[0])
        await asyncio.wait_for(channel.call("close"), 60)
        return out
    finally:
        channel.close()


def contexts(replica) -> int:
    path, engine, loop = replica
    return asyncio.run_coroutine_threadsafe(engine.stats(), loop).result(30).contexts


def test_a_flood_without_a_handshake_is_refused_unread_while_bobs_passes_complete(replica, caplog):
    path = replica[0]
    unloaded = asyncio.run(generate(path, "bob"))
    # the attack from the issue: one frame of 80,000 requests naming no capability (about 2.5 MB)
    flood = msgpack.packb([[i, "nobody", "create", []] for i in range(80_000)])
    sent: list = []

    def alice():
        raw = connect(path)
        try:
            raw.sendall(flood)
            sent.append("all of it")
        except (BrokenPipeError, ConnectionResetError):
            sent.append("cut off")
        sent.append(refusal(raw))
        raw.close()

    attacker = threading.Thread(target=alice)
    with caplog.at_level(logging.DEBUG):
        attacker.start()
        loaded = asyncio.run(generate(path, "bob"))
        attacker.join(60)
    assert loaded == unloaded, "bob's passes on the replica alice flooded"
    assert sent[0] == "cut off", "the replica read the whole unauthenticated frame"
    # (msgpack tells from the array's header that it is no handshake, or the handshake's room fills up first)
    assert sent[1] in ("malformed handshake: ValueError", f"no handshake within {HANDSHAKE_BYTES} bytes"), sent
    assert not [r for r in caplog.records if r.exc_info], "a refused connection was logged with a traceback"
    assert contexts(replica) == 0


def test_requests_before_the_handshake_are_refused(replica):
    path = replica[0]
    alice = TRUST.instance("alice")["capability"]
    raw = connect(path)
    raw.sendall(msgpack.packb([[0, f"{alice}/s", "create", []]]))  # a valid session, but no handshake first
    assert refusal(raw) == 'the first frame must be the handshake ["hello", capability]'
    raw.close()
    raw = connect(path)
    raw.sendall(hello("alice-says-she-is-bob"))
    assert refusal(raw).startswith("malformed capability")
    raw.close()
    assert contexts(replica) == 0


def test_connections_past_the_per_instance_bound_are_refused_naming_the_limit(replica):
    path = replica[0]
    alice = TRUST.instance("alice")["capability"]
    held = []
    for _ in range(LIMITS.per_instance):
        raw = connect(path)
        raw.sendall(hello(alice) + msgpack.packb([[0, f"{alice}/s", "stats", []]]))
        assert msgpack.unpackb(raw.recv(1 << 16))[0][1] is None  # answered: it was admitted
        held.append(raw)
    extra = connect(path)
    extra.sendall(hello(alice))
    assert "connections_per_instance = 4" in refusal(extra)
    extra.close()
    assert asyncio.run(generate(path, "bob")), "bob connects as before"
    held.pop().close()
    time.sleep(0.2)
    again = connect(path)  # one closed: room for one more
    again.sendall(hello(alice) + msgpack.packb([[0, f"{alice}/s", "stats", []]]))
    assert msgpack.unpackb(again.recv(1 << 16))[0][1] is None
    for raw in [*held, again]:
        raw.close()


def test_unverified_connections_are_bounded_per_peer_and_time_out(replica, caplog):
    path = replica[0]
    with caplog.at_level(logging.WARNING, logger="pie_workers.engine.channel"):
        idle = [connect(path) for _ in range(LIMITS.waiting_per_peer + 1)]  # no handshake: the oldest is closed
        assert "waiting_per_peer = 4" in refusal(idle[0])
        for raw in idle[1:]:  # the rest, once their handshake is overdue
            assert refusal(raw) == f"no handshake within {LIMITS.handshake_s:g} s"
            raw.close()
    assert len(caplog.records) <= 1, "five refusals within seconds, each logged"
    assert asyncio.run(generate(path, "bob")), "bob connects as before"
