"""The inferlet channel under load: every request gets its reply, however requests and replies interleave, and
a connection that sends garbage is dropped without disturbing the others."""

from __future__ import annotations

import asyncio
import random
import socket
import threading

import msgpack
import pytest
from inferlet._channel import Channel, ReplicaError
from pie_workers.engine.channel import ChannelServer
from pie_workers.engine.record import Sessions
from support.sdk_host import TRUST


def named(user: str, instance: str, key: str) -> str:
    """A session string with a valid capability (the channel verifies every connection's handshake)."""
    return f"{TRUST.instance(user, instance)['capability']}/{key}"


def _echo(session: str, op: str, args: list, answer):
    """Half the requests run as tasks, half are answered through the callback (as the engine answers forwards);
    some replies leave in a later loop iteration than their request arrived in."""
    if random.random() < 0.5:
        return _echo_task(session, op, args)
    if op == "fail":
        raise ValueError(f"{session} asked to fail")
    reply = [session, args[0]]
    if random.random() < 0.3:
        asyncio.get_running_loop().call_soon(answer, None, reply)
    else:
        answer(None, reply)
    return None


async def _echo_task(session: str, op: str, args: list):
    if random.random() < 0.3:
        await asyncio.sleep(0)
    if op == "fail":
        raise ValueError(f"{session} asked to fail")
    return [session, args[0]]


def _serve() -> tuple[str, ChannelServer]:
    bound: list = []

    async def main():
        server = ChannelServer(_echo, Sessions(TRUST.secret))
        bound.append((server.bind("127.0.0.1")["ipc"], server))
        await server.serve()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    while not bound:
        threading.Event().wait(0.01)
    return bound[0]


def test_many_sessions_interleaving_requests_all_get_their_own_replies():
    address, _ = _serve()

    async def session(i: int):
        name = named("alice", "1", str(i))
        channel = Channel(address, name)
        try:
            for k in range(300):
                assert await asyncio.wait_for(channel.call("echo", k), 10) == [name, k]
            try:
                await asyncio.wait_for(channel.call("fail", 0), 10)
            except ValueError as e:
                assert str(e) == f"{name} asked to fail"
            else:
                raise AssertionError("a failing op did not raise")
        finally:
            channel.close()

    async def all_sessions():
        await asyncio.gather(*(session(i) for i in range(64)))

    for _ in range(5):
        asyncio.run(all_sessions())


def test_a_malformed_frame_drops_only_that_connection():
    address, _ = _serve()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(address.removeprefix("ipc://"))
    raw.settimeout(10)
    raw.sendall(b"\xc1")  # a byte msgpack never uses
    unpacker = msgpack.Unpacker()
    while data := raw.recv(1 << 16):  # until the server closes the connection
        unpacker.feed(data)
    assert list(unpacker) == [[[None, "PermissionError", "malformed handshake: FormatError"]]]
    bob = named("bob", "1", "s")

    async def still_served():
        channel = Channel(address, bob)
        try:
            return await asyncio.wait_for(channel.call("echo", 7), 10)
        finally:
            channel.close()

    assert asyncio.run(still_served()) == [bob, 7]


def test_a_lost_connection_fails_pending_calls_with_a_clear_error():
    async def main():
        async def work(op: str, args: list):
            await asyncio.sleep(30 if op == "hang" else 0)
            return args[0]

        def handler(session: str, op: str, args: list, answer):
            return work(op, args)

        server = ChannelServer(handler, Sessions(TRUST.secret))
        address = server.bind("127.0.0.1")["ipc"]
        serving = asyncio.ensure_future(server.serve())
        channel = Channel(address, named("carol", "1", "s"))
        assert await asyncio.wait_for(channel.call("echo", 1), 10) == 1
        hanging = channel.call("hang", 2)
        await asyncio.sleep(0.05)
        serving.cancel()
        server.close()  # the replica goes away with a call in flight
        with pytest.raises(ReplicaError, match="lost the connection"):
            await asyncio.wait_for(hanging, 10)
        with pytest.raises(ReplicaError, match="cannot reach the replica"):
            await asyncio.wait_for(channel.call("echo", 3), 10)

    asyncio.run(main())
