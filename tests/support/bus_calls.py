"""Test helper for the bus tests: its name, what a shard holds for a user when nothing is left behind, running
inferlets against a bus in this process as a host does, and the ping/pong and pusher/puller inferlets."""

from __future__ import annotations

import asyncio

from inferlet import messaging
from pie_cluster.bus import BusStats
from pie_cluster.hosts.run import run_inferlet
from support.sdk_host import TRUST

BUS = "pie-bus-test"
NOTHING_HELD = BusStats()


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
    while any(getattr(bus.stats(user), name) != count for name, count in expected.items()):
        await asyncio.sleep(0.01)


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


async def pusher(input: dict) -> None:
    for i in range(input["n"]):
        messaging.push("work", str(i))
        if i % 50 == 0:
            await asyncio.sleep(0)


async def puller(input: dict) -> list[int]:
    return [int(await messaging.pull("work")) for _ in range(input["n"])]
