"""A real replica engine (the tiny model's runner) under garbage on its channel, as an attacker or a buggy client
would send it: truncated and malformed frames, frames past the size limit, well-formed frames with wrong types and
unknown operations, and connections that vanish holding contexts; each after a valid handshake, after a fuzzed one,
or with none.

Each bad connection is closed or answered with errors, never the engine: a well-behaved inferlet is served after
every example, and once the bad connections are gone they hold no context and no page. Requests come from sessions
with valid capabilities and from sessions without (those are refused and their connection closed)."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inferlet._channel import Channel
from pie_workers.engine.channel import MAX_FRAME_BYTES
from pie_workers.engine.engine_stats import EngineStats
from pie_workers.engine.service import ReplicaEngine
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.messages import PassReply, PassRequest, decode, encode
from support.engine_harness import SAMPLER, serving
from support.sdk_host import TRUST

PAGES = 64
OPS = ["create", "destroy", "close", "fork", "save", "keep", "snapshot", "open", "take", "delete", "truncate", "stats",
       "account", "suspend", "set_bid", "forward", "adapter_create", "adapter_load", "no-such-op"]  # fmt: skip


def session(user: str, instance: str, key: str) -> str:
    """A session string with a valid capability, as the SDK's ``Model`` names its requests."""
    return f"{TRUST.instance(user, instance)['capability']}/{key}"


@pytest.fixture(scope="module")
def replica(tiny_llama):
    """The engine serving its channel on a loop in a background thread; its ipc path, and the engine."""
    return serving(lambda: ReplicaEngine(ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES)), secret=TRUST.secret))


def stats(replica) -> EngineStats:
    path, engine, loop = replica
    return asyncio.run_coroutine_threadsafe(engine.stats(), loop).result(30)


def hello(user: str = "fuzz", instance: str = "1") -> bytes:
    """A valid handshake, as the SDK opens every connection with."""
    return msgpack.packb(["hello", TRUST.instance(user, instance)["capability"]])


def send_and_drop(path: str, payload: bytes, greeting: bytes | None = None) -> None:
    """Send ``payload`` on a fresh connection (after ``greeting``, default a valid handshake) and read whatever
    comes back until the engine closes it; the sessions it named are never closed by the client."""
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(path)
    raw.settimeout(10)
    try:
        raw.sendall((hello() if greeting is None else greeting) + payload)
        raw.shutdown(socket.SHUT_WR)  # end of input: the engine answers what it got, then closes
        while raw.recv(1 << 16):
            pass
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        raw.close()


def a_good_inferlet_is_served(path: str) -> None:
    """Create a context, run a forward pass sampling a token, destroy it, close: all answered."""

    async def run():
        channel = Channel(f"ipc://{path}", session("good", "1", "s"))
        try:
            ctx = await asyncio.wait_for(channel.call("create"), 30)
            slots = [[2, SAMPLER]]
            request = PassRequest(ctx, tokens=[5, 6, 7], positions=[0, 1, 2], slots=slots)
            answer = await asyncio.wait_for(channel.call("forward", encode(request)), 30)
            assert isinstance(decode(PassReply, answer).slots[0][1], int)
            await asyncio.wait_for(channel.call("destroy", ctx), 30)
            await asyncio.wait_for(channel.call("close"), 30)
        finally:
            channel.close()

    asyncio.run(run())


numbers = st.integers(-(2**63), 2**64 - 1) | st.floats()
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12), st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner))
sessions = st.one_of(
    st.sampled_from([session("fuzz", "1", "a"), session("fuzz", "2", "b"), "fuzz/1/a", "nobody", "a/b/c/d", ""]),
    values,
)
requests = st.tuples(st.integers(0, 2**31), sessions, st.sampled_from(OPS) | values, st.lists(values, max_size=18))
frames = st.one_of(
    st.lists(requests.map(list), min_size=1, max_size=6).map(msgpack.packb),  # well-formed, wrong contents
    st.lists(requests.map(list), min_size=1, max_size=3)
    .map(msgpack.packb)
    .flatmap(  # cut short
        lambda b: st.integers(1, max(1, len(b) - 1)).map(lambda n: b[:n])
    ),
    values.map(msgpack.packb),  # not a list of requests at all
    st.binary(min_size=1, max_size=64),  # not msgpack
)
greetings = st.one_of(
    st.builds(hello),  # valid
    st.just(b""),  # none: the frame comes first
    st.sampled_from(["fuzz", "nobody", "", "a/b"]).map(lambda token: msgpack.packb(["hello", token])),
    values.map(lambda token: msgpack.packb(["hello", token])),  # a handshake of the wrong shape
    values.map(msgpack.packb),
    st.binary(min_size=1, max_size=64),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(greetings, frames)
def test_garbage_frames_never_hurt_the_engine_or_other_inferlets(replica, greeting, frame):
    path = replica[0]
    send_and_drop(path, frame, greeting)
    a_good_inferlet_is_served(path)


def test_a_frame_past_the_size_limit_drops_only_that_connection(replica):
    path = replica[0]
    header = b"\xc6" + (MAX_FRAME_BYTES + 16).to_bytes(4, "big")  # msgpack bin32 announcing more than the limit
    send_and_drop(path, header + b"\0" * (MAX_FRAME_BYTES + 16))
    a_good_inferlet_is_served(path)


def test_contexts_of_a_connection_that_vanished_are_released(replica):
    """A process that dies holding contexts (its host killed) never sends `close`: the engine closes its sessions
    when the connection drops, so the fuzzing above leaves nothing behind either."""
    path = replica[0]
    creates = [[i, session("vanished", "1", "s"), "create", []] for i in range(5)]
    send_and_drop(path, msgpack.packb(creates))
    for _ in range(100):
        got = stats(replica)
        if got.contexts == 0:
            break
        threading.Event().wait(0.05)
    assert got.contexts == 0 and got.free + got.cached == got.total, got


def test_a_context_made_after_its_session_closed_in_the_same_frame_is_released(replica):
    """``close`` then ``create`` (or ``fork``) of one session in one frame: the close runs first and forgets the
    session, so the connection's drop finds nothing to close; the context made after it is released at once."""
    path = replica[0]
    name = session("closing", "1", "s")
    send_and_drop(path, msgpack.packb([[0, name, "close", []], [1, name, "create", []], [2, name, "create", []]]))
    got = stats(replica)
    assert got.contexts == 0 and got.free + got.cached == got.total, got
