"""A capability ends with its instance, end to end: alice's uploaded program runs in her sandboxed worker on a real
cluster, uses the replica, and hands its capability out as its return value (as a program could leak it to a
process that outlives it). Once the instance ended, its node's host has revoked the capability on every replica and
bus shard: it opens no connection to either, while bob's instance, launched after it, runs as before."""

from __future__ import annotations

import json
import time

import msgpack
import ray
from pie_cluster.bus import find_bus
from support.launching import SAVES_AND_WAITS, launch, run_to_end, upload
from test_capabilities_bus import dealer, events
from test_capabilities_replica import Raw, session

LEAKS = """
from inferlet import Context, Model, runtime

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("hello")
        await ctx.flush()
    return runtime.current().capability
"""


def refused_by_the_replica(address: str, capability: str) -> str | None:
    """The replica's refusal of a connection opened with ``capability``, or None if it serves it."""
    raw = Raw(address, capability)
    try:
        error, message = raw.call(session(capability), "stats")
        return message if error == "PermissionError" else None
    finally:
        raw.close()


def test_an_ended_instances_capability_is_refused_everywhere(cluster, launcher):
    instance = launch(launcher, upload(launcher, LEAKS))
    _, kind, capability = run_to_end(launcher, instance)[-1]  # (a string returned is the event's value itself)
    assert kind == "return", capability
    here = ray.get_runtime_context().get_node_id()
    addresses = [e.address for e in ray.get(cluster.replica_endpoints.remote(here))["default"]]
    revoked = f"revoked capability: instance {instance!r} has ended"
    for address in addresses:  # (the host's revocation is sent once the ending is out: give it a moment)
        deadline = time.monotonic() + 30
        while (why := refused_by_the_replica(address, capability)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert why == revoked, (address, why)
    for address in find_bus().addresses():
        sock = dealer(address, f"{instance}/s".encode())
        sock.send_multipart([capability.encode(), msgpack.packb([["sub", "news", 1]])])
        assert events(sock) == [["refused", revoked]]
        sock.close()

    bob = launch(launcher, upload(launcher, SAVES_AND_WAITS, user="bob"), user="bob")
    _, kind, tokens = run_to_end(launcher, bob, user="bob")[-1]
    assert kind == "return" and len(json.loads(tokens)) == 8, tokens
