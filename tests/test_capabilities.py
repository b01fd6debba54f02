"""Identity from the trusted side: replicas and bus shards believe only capabilities signed with the cluster's
secret, never a name the client sends.

The token check is fuzzed on its own (random text, tampered payload fields, flipped signature bits, a wrong secret,
expiry); then attackers speak the wire protocols by hand over real sockets — the replica channel over Unix sockets
and TCP, a bus shard through a raw ZeroMQ DEALER — claiming to be bob with a forged capability, with alice's genuine
one, or with bob's expired one. Each is refused (the replica also hangs up) and bob's snapshot and queue stay his.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import socket
import time

import msgpack
import pytest
import ray
import zmq
from engine_harness import SAMPLER
from hypothesis import given, settings
from hypothesis import strategies as st
from inferlet import Context, Model, messaging, runtime
from inferlet.messaging import BusError
from pie_cluster.bus import start_bus
from pie_cluster.bus.shard import BusShard
from pie_cluster.host import endpoints_for, run_inferlet
from pie_workers.wire.capability import CapabilityError, mint, verify
from pie_workers.wire.messages import PassRequest, encode
from sdk_host import TRUST

SECRET = TRUST.secret
NOTHING_HELD = {"sessions": 0, "topics": 0, "queued": 0, "waiters": 0, "subscriptions": 0}


def claims(token: str) -> list:
    """The payload of a token, [user, instance, expires], read without checking anything."""
    payload = token.split(".")[0]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def forged(token: str, **changes) -> str:
    """``token`` with fields of its payload changed (user, instance, expires), its signature kept."""
    user, instance, expires = claims(token)
    fields = {"user": user, "instance": instance, "expires": expires} | changes
    payload = json.dumps([fields["user"], fields["instance"], fields["expires"]], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(payload).decode().rstrip("=") + "." + token.split(".")[1]


def expired(user: str, instance: str) -> str:
    """A capability minted with the cluster's secret whose lifetime is over."""
    token = mint(SECRET, user, instance, 0.01)
    time.sleep(0.02)
    return token


# -- the token ----------------------------------------------------------------------------------------------------

names = st.text(max_size=40)


@settings(max_examples=300, deadline=None)
@given(user=names, instance=names, ttl=st.floats(1, 1e7))
def test_a_minted_capability_verifies_and_is_printable_without_slashes(user, instance, ttl):
    token = mint(SECRET, user, instance, ttl)
    assert token.isascii() and token.isprintable() and "/" not in token and " " not in token
    got = verify(SECRET, token)
    assert (got.user, got.instance) == (user, instance) and got.expires > time.time()


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_random_text_is_never_a_capability(text):
    with pytest.raises(CapabilityError, match="malformed|bad capability signature"):
        verify(SECRET, text)


@settings(max_examples=300, deadline=None)
@given(
    user=names,
    instance=names,
    field=st.sampled_from(["user", "instance", "expires"]),
    other=names | st.floats(allow_nan=False) | st.integers(),
)
def test_a_changed_payload_field_breaks_the_signature(user, instance, field, other):
    token = mint(SECRET, user, instance, 3600)
    tampered = forged(token, **{field: other})
    if tampered != token:
        with pytest.raises(CapabilityError, match="bad capability signature"):
            verify(SECRET, tampered)


@settings(max_examples=300, deadline=None)
@given(user=names, bit=st.integers(0, 255))
def test_a_flipped_signature_bit_is_refused(user, bit):
    payload, signature = mint(SECRET, user, "i", 3600).split(".")
    raw = bytearray(base64.urlsafe_b64decode(signature + "="))
    raw[bit // 8] ^= 1 << (bit % 8)
    flipped = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    with pytest.raises(CapabilityError, match="bad capability signature"):
        verify(SECRET, f"{payload}.{flipped}")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_changed_character_is_refused(data):
    token = mint(SECRET, data.draw(names), data.draw(names), 3600)
    at = data.draw(st.integers(0, 1 << 16)) % len(token)  # the token's length varies with the clock
    char = data.draw(st.characters().filter(lambda c: c != token[at]))
    with pytest.raises(CapabilityError):
        verify(SECRET, token[:at] + char + token[at + 1 :])


@settings(max_examples=200, deadline=None)
@given(secret=st.binary(min_size=1, max_size=64).filter(lambda s: s != SECRET), user=names)
def test_a_capability_minted_with_another_secret_is_refused(secret, user):
    with pytest.raises(CapabilityError, match="bad capability signature"):
        verify(SECRET, mint(secret, user, "i", 3600))


@settings(max_examples=200, deadline=None)
@given(ttl=st.floats(0.001, 1e7), later=st.floats(0, 1e7))
def test_a_capability_past_its_lifetime_is_refused(ttl, later):
    token = mint(SECRET, "alice", "i", ttl)
    with pytest.raises(CapabilityError, match="expired capability"):
        verify(SECRET, token, now=claims(token)[2] + later)


def test_minting_needs_a_secret_and_a_lifetime():
    with pytest.raises(ValueError, match="secret"):
        mint(b"", "alice", "i", 60)
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lifetime"):
            mint(SECRET, "alice", "i", ttl)


def test_no_replica_or_bus_shard_runs_without_a_secret(ray_session, tiny_llama):
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica

    with pytest.raises(ValueError, match="secret"):
        Replica(tiny_llama, 1, engine=BatchLimits())
    with pytest.raises(ValueError, match="secret"):
        BusShard(0, 1, b"")


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
    """A client writing the replica channel's frames by hand, as an attacker's program would."""

    def __init__(self, address: str):
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

    def send(self, *requests: tuple) -> list[int]:
        """Send one frame of (session, op, *args) requests; returns their request ids."""
        frame = [[next(self._ids), session, op, list(args)] for session, op, *args in requests]
        self.sock.sendall(msgpack.packb(frame))
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
        """[error type or None, result or message] of one request."""
        (rid,) = self.send((session, op, *args))
        while True:
            for frame in self._unpacker:
                for got, error, value in frame:
                    if got == rid:
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


def stats(replica) -> dict:
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
    before = stats(replica)["contexts"]
    alice = TRUST.instance("alice")["capability"]
    raw = Raw(replica.addresses["ipc"])
    forgery = forged(alice, instance="someone-else")
    rids = raw.send((session(alice), "create"), (session(forgery), "create"), (session(alice), "create"))
    replies = raw.replies()  # the first create runs as a task, done after the refusal: its reply is not sent either
    assert [r[:2] for r in replies] == [[rids[1], "PermissionError"]], replies
    raw.close()
    for _ in range(200):  # the context made before the refusal is released with the connection
        if stats(replica)["contexts"] == before:
            break
        time.sleep(0.05)
    assert stats(replica)["contexts"] == before


def test_a_session_whose_capability_expires_is_refused_from_then_on(replica):
    before = stats(replica)["contexts"]
    short = mint(SECRET, "alice", "brief", 1.0)
    raw = Raw(replica.addresses["tcp"])
    error, ctx = raw.call(session(short), "create")
    assert error is None and stats(replica)["contexts"] == before + 1
    time.sleep(max(0.0, claims(short)[2] - time.time()) + 0.05)
    error, message = raw.call(session(short), "destroy", ctx)
    assert error == "PermissionError" and "expired capability" in message and raw.hung_up()
    raw.close()
    for _ in range(200):
        if stats(replica)["contexts"] == before:
            break
        time.sleep(0.05)
    assert stats(replica)["contexts"] == before


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
        request = PassRequest(ctx, tokens=prompt, positions=list(range(len(prompt))), slots=[[len(prompt) - 1, SAMPLER]])
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
    assert bus.stats("bob")["queued"] == 1
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
    assert bus.stats("alice")["waiters"] == 1 and bus.stats("bob")["queued"] == 1
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
