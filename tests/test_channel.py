"""The inferlet channel under load: every request gets its reply, however requests and replies interleave.

A regression test for a lost wakeup: sending on a raw shadow of a zmq.asyncio socket skipped the re-check of
ZeroMQ's edge-triggered descriptor, so a reply that arrived during a send could leave the reader asleep for good.
"""

from __future__ import annotations

import asyncio
import random
import threading

from inferlet._channel import Channel
from pie_workers.engine.channel import ChannelServer


async def _echo(session: str, op: str, args: list):
    if random.random() < 0.3:  # some replies leave in a later loop iteration than their request arrived in
        await asyncio.sleep(0)
    if op == "fail":
        raise ValueError(f"{session} asked to fail")
    return [session, args[0]]


def _serve() -> tuple[str, ChannelServer]:
    bound: list = []

    async def main():
        server = ChannelServer(_echo)
        bound.append((server.bind("127.0.0.1")["ipc"], server))
        await server.serve()

    threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
    while not bound:
        threading.Event().wait(0.01)
    return bound[0]


def test_many_sessions_interleaving_requests_all_get_their_own_replies():
    address, _ = _serve()

    async def session(i: int):
        channel = Channel(address, f"alice/1/{i}")
        try:
            for k in range(300):
                assert await asyncio.wait_for(channel.call("echo", k), 10) == [f"alice/1/{i}", k]
            try:
                await asyncio.wait_for(channel.call("fail", 0), 10)
            except ValueError as e:
                assert str(e) == f"alice/1/{i} asked to fail"
            else:
                raise AssertionError("a failing op did not raise")
        finally:
            channel.close()

    async def all_sessions():
        await asyncio.gather(*(session(i) for i in range(64)))

    for _ in range(5):
        asyncio.run(all_sessions())
