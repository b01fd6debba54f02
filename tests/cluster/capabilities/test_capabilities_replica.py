"""Capabilities on the replica channel, attacked by hand over Unix sockets and TCP: claiming to be bob with a
forged capability, with alice's genuine one or with bob's expired one, nobody but bob opens bob's snapshot; a
refused request ends its frame and the replica hangs up; an inferlet with a forged capability fails clearly while
its neighbours run on; and a market wallet is only ever the verified instance's. The token itself is fuzzed in
``test_capabilities.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import time

import msgpack
import pytest
import ray
from inferlet import Context, Model, runtime
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_workers.engine.engine_stats import EngineStats
from pie_workers.wire.capability import mint
from pie_workers.wire.messages import PassRequest, encode
from support.engine_harness import SAMPLER
from support.forgery import SECRET, claims, expired, forged
from support.sdk_host import TRUST

# -- the replica channel ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica(ray_session, tiny_llama, market):
    """The tiny model's replica, reporting to a market, verifying capabilities with the test session's secret."""
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings

    settings = RunnerSettings(num_pages=64)
    replica = Replica(tiny_llama, 1, settings, cpus_per_rank=1, engine=BatchLimits(), market=market, secret=SECRET)
    yield replica
    replica.shutdown()


class Raw:
    """A client writing the replica channel's frames by hand, as an attacker's program would. Its first write is a
    handshake with ``capability``, or (None) with the capability of the first request's session, sent with the first
    requests as the SDK's: a replica that refuses it closes the connection, and a handshake written on its own
    could leave the requests meeting a closed socket instead of reading the refusal."""

    def __init__(self, address: str, capability: str | None = None):
        kind, _, where = address.partition("://")
        if kind == "ipc":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(where)
        else:
            host, _, port = where.rpartition(":")
            self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(30)
        self._unpacker = msgpack.Unpacker()
        self._ids = itertools.count()
        self._capability = capability
        self._greeted = False

    def send(self, *requests: tuple) -> list[int]:
        """Send one frame of (session, op, *args) requests, the handshake first in the same write if none was
        sent yet; returns their request ids."""
        frame = [[next(self._ids), session, op, list(args)] for session, op, *args in requests]
        capability = self._capability or frame[0][1].partition("/")[0]
        hello = b"" if self._greeted else msgpack.packb(["hello", capability])
        self._greeted = True
        self.sock.sendall(hello + msgpack.packb(frame))
        return [request[0] for request in frame]

    def replies(self) -> list:
        """Every reply until the replica hangs up or has been quiet for a second."""
        got: list = []
        self.sock.settimeout(1.0)
        try:
            while data := self.sock.recv(1 << 16):
                self._unpacker.feed(data)
                for frame in self._unpacker:
                    got.extend(frame)
        except TimeoutError:
            pass
        finally:
            self.sock.settimeout(30)
        return got

    def call(self, session: str, op: str, *args) -> list:
        """[error type or None, result or message] of one request, or of the refusal of the connection."""
        (rid,) = self.send((session, op, *args))
        while True:
            for frame in self._unpacker:
                for got, error, value in frame:
                    if got in (rid, None):
                        return [error, value]
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the replica closed the connection without answering")
            self._unpacker.feed(data)

    def hung_up(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def session(capability: str, key: str = "s") -> str:
    return f"{capability}/{key}"


def stats(replica) -> EngineStats:
    return ray.get(replica.leader.engine_stats.remote())


async def saves_a_snapshot(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("bob's private notes")
        await ctx.flush()
        ctx.save(input["name"])


async def opens_a_snapshot(input) -> int | None:
    ctx = Context.open(Model.load("default"), input["name"])
    if ctx is None:
        return None
    with ctx:
        return ctx.seq_len


def run_as(replica, user: str, main, input: dict):
    endpoints = endpoints_for("default", replica)
    return asyncio.run(run_inferlet(main, input, endpoints, user, **TRUST.instance(user)))


@pytest.fixture(scope="module")
def bobs_snapshot(replica) -> str:
    run_as(replica, "bob", saves_a_snapshot, {"name": "bob-private"})
    return "bob-private"


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_nobody_but_bob_opens_bobs_snapshot(replica, bobs_snapshot, transport):
    address = replica.addresses[transport]
    alice = TRUST.instance("alice")
    attempts = [  # (the session the request names, what the refusal says)
        (session(forged(alice["capability"], user="bob")), "bad capability signature"),
        (f"bob/{alice['instance_id']}/s", "malformed capability"),  # the old user/instance/session names
        (alice["capability"], "malformed session"),  # a capability without a session key
        (session(mint(b"a secret of the attacker's own", "bob", "i", 3600)), "bad capability signature"),
        (session(expired("bob", "i")), "expired capability"),
    ]
    for claim, problem in attempts:
        raw = Raw(address)
        error, message = raw.call(claim, "open", bobs_snapshot)
        assert error == "PermissionError" and message.startswith(problem), (problem, message)
        assert raw.hung_up(), f"the replica keeps talking to a client refused for: {problem}"
        raw.close()

    raw = Raw(address)  # alice's genuine capability: she is alice, and alice has no such snapshot
    assert raw.call(session(alice["capability"]), "open", bobs_snapshot) == [None, None]
    assert raw.call(session(alice["capability"]), "close") == [None, 0]
    raw.close()
    assert run_as(replica, "bob", opens_a_snapshot, {"name": bobs_snapshot}) > 0


def test_the_escape_from_the_issue_acts_as_alice_still(replica, bobs_snapshot):
    """Alice's inferlet rebuilds its runtime with bob's name: its requests still carry alice's capability."""

    async def impersonates(input):
        as_bob = dataclasses.replace(runtime.current(), username="bob", models_loaded={})
        model = Model(as_bob.endpoints["default"], as_bob)
        try:
            return Context.open(model, input["name"])
        finally:
            model.close()

    assert run_as(replica, "alice", impersonates, {"name": bobs_snapshot}) is None


def test_an_inferlet_with_a_forged_capability_fails_clearly_and_its_neighbours_run_on(replica):
    endpoints = endpoints_for("default", replica)
    bob = TRUST.instance("bob")

    async def creates(input):
        with Context(Model.load("default")) as ctx:
            return ctx.model.name

    async def both():
        with pytest.raises(PermissionError, match="bad capability signature"):
            await run_inferlet(
                creates, {}, endpoints, "bob", **(bob | {"capability": forged(bob["capability"], expires=1e12)})
            )
        return await run_inferlet(creates, {}, endpoints, "bob", **bob)

    assert asyncio.run(both()) == "default"  # the same thread's next inferlet got a new connection


def test_a_refused_request_ends_the_frame_and_the_connection(replica):
    before = stats(replica).contexts
    alice = TRUST.instance("alice")["capability"]
    raw = Raw(replica.addresses["ipc"])
    forgery = forged(alice, instance="someone-else")
    rids = raw.send((session(alice), "create"), (session(forgery), "create"), (session(alice), "create"))
    replies = raw.replies()  # the first create runs as a task, done after the refusal: its reply is not sent either
    assert [r[:2] for r in replies] == [[rids[1], "PermissionError"], [None, "PermissionError"]], replies
    raw.close()
    for _ in range(200):  # the context made before the refusal is released with the connection
        if stats(replica).contexts == before:
            break
        time.sleep(0.05)
    assert stats(replica).contexts == before


def test_a_session_whose_capability_expires_is_refused_from_then_on(replica):
    before = stats(replica).contexts
    short = mint(SECRET, "alice", "brief", 1.0)
    raw = Raw(replica.addresses["tcp"])
    error, ctx = raw.call(session(short), "create")
    assert error is None and stats(replica).contexts == before + 1
    time.sleep(max(0.0, claims(short)[2] - time.time()) + 0.05)
    error, message = raw.call(session(short), "destroy", ctx)
    assert error == "PermissionError" and "expired capability" in message and raw.hung_up()
    raw.close()
    for _ in range(200):
        if stats(replica).contexts == before:
            break
        time.sleep(0.05)
    assert stats(replica).contexts == before


# -- the market ---------------------------------------------------------------------------------------------------


def test_a_wallet_is_only_ever_the_verified_instances(replica, market):
    """The only wallet a client reaches is its own capability's instance's: reading it, and paying for the pages it
    makes; claiming another instance's is refused."""
    mine, theirs = TRUST.instance("alice"), TRUST.instance("bob")
    ray.get([market.join.remote(mine["instance_id"], 50.0), market.join.remote(theirs["instance_id"], 77.0)])
    raw = Raw(replica.addresses["ipc"])
    try:
        assert raw.call(session(mine["capability"]), "account")[1]["balance"] == 50.0
        error, ctx = raw.call(session(mine["capability"]), "create")
        prompt = list(range(5, 40))
        request = PassRequest(
            ctx, tokens=prompt, positions=list(range(len(prompt))), slots=[[len(prompt) - 1, SAMPLER]]
        )
        assert raw.call(session(mine["capability"]), "forward", encode(request))[0] is None
        for _ in range(200):  # its pages are charged at the market's next round
            if raw.call(session(mine["capability"]), "account")[1]["balance"] < 50.0:
                break
            time.sleep(0.05)
        assert raw.call(session(mine["capability"]), "account")[1]["balance"] < 50.0
        assert raw.call(session(mine["capability"]), "close") == [None, 1]
        assert ray.get(market.account.remote(theirs["instance_id"]))["balance"] == 77.0

        error, message = raw.call(session(forged(mine["capability"], instance=theirs["instance_id"])), "account")
        assert error == "PermissionError" and "bad capability signature" in message and raw.hung_up()
    finally:
        raw.close()
        ray.get([market.leave.remote(mine["instance_id"]), market.leave.remote(theirs["instance_id"])])
