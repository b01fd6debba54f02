"""The typed messages between SDK and engine (``pie_workers.wire.messages``): what survives the trip through msgpack
by field name, and what a real engine refuses, by name, when a request is not one of them."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pie_workers.wire.messages import (
    AccountReply,
    AdapterReply,
    ContextReply,
    PassKind,
    PassReply,
    PassRequest,
    decode,
    encode,
)
from support.engine_harness import PROMPT, SAMPLER, SESSION, Engine, run

ids = st.lists(st.integers(0, 1 << 20), max_size=8)
optional_int = st.none() | st.integers(-(1 << 40), 1 << 40)
requests = st.builds(
    PassRequest,
    ctx=st.integers(0, 1 << 30),
    kind=st.sampled_from(list(PassKind)),
    tokens=ids,
    positions=ids,
    slots=st.lists(st.tuples(st.integers(0, 8), st.just(SAMPLER)).map(list), max_size=3),
    attention_masks=st.none() | st.lists(ids, max_size=3),
    logit_mask=st.none() | st.binary(max_size=16),
    drafts=ids,
    draft_positions=ids,
    draft_masks=st.none() | st.lists(st.binary(max_size=8), max_size=3),
    draft_budget=st.integers(0, 8),
    hold=st.integers(0, 64),
    adapter=optional_int,
    zo_seed=optional_int,
    bid=st.none() | st.floats(0, 1e6),
    steps=st.integers(1, 16),
    stop_ids=ids,
    run_ahead=st.booleans(),
)


@given(requests)
def test_a_pass_request_survives_the_wire_field_by_field(request):
    assert decode(PassRequest, msgpack.unpackb(msgpack.packb(encode(request)))) == request


@given(st.builds(PassReply, seq_len=st.integers(0, 1 << 20), walk=ids, next_drafts=ids))
def test_a_pass_reply_survives_the_wire(reply):
    assert decode(PassReply, msgpack.unpackb(msgpack.packb(encode(reply)))) == reply


def test_fields_at_their_defaults_stay_off_the_wire_and_every_reply_names_its_fields():
    assert encode(PassRequest(7, tokens=[1, 2], positions=[0, 1])) == {"ctx": 7, "tokens": [1, 2], "positions": [0, 1]}
    assert encode(ContextReply(3, 10)) == {"ctx": 3, "seq_len": 10}
    assert set(encode(AdapterReply(1, 8, 16.0, ["q_proj"]))) == {"id", "rank", "alpha", "targets"}
    reply = AccountReply(balance=1.0, endowment=2.0, dividend=0.0, paid=0.5, page_cost=1.0, price=0.1, latency=0.01)
    assert decode(AccountReply, encode(reply)) == reply


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"ctx": 0, "tokens": [5], "positions": [0], "stop": [2]}, r"malformed PassRequest: unknown fields \['stop'\]"),
        ({"tokens": [5], "positions": [0]}, r"malformed PassRequest: missing fields \['ctx'\]"),
        ([0, [5], [0]], "a PassRequest travels as a map of its fields"),
    ],
)
def test_a_forward_that_is_not_a_pass_request_is_refused_by_name(runner, message, error):
    async def body(e: Engine):
        with pytest.raises(ValueError, match=error):
            e.engine._handle(SESSION, "forward", [message], None)
        return await e.call("create")  # the engine serves on

    assert isinstance(run(runner, body), int)


def test_an_unknown_kind_of_pass_fails_that_pass_and_the_context_goes_on(runner):
    async def body(e: Engine):
        ctx, first = await e.prefilled(PROMPT)
        future = asyncio.get_running_loop().create_future()
        request = {"ctx": ctx, "kind": "sideways", "tokens": [first], "positions": [len(PROMPT)]}
        e.engine._handle(SESSION, "forward", [request], lambda error, _: future.set_result(error))
        error = await future
        [_, _, seq_len, _] = await e.forward(ctx, [first], len(PROMPT))
        return str(error), seq_len

    error, seq_len = run(runner, body)
    assert "unknown pass kind 'sideways'" in error and seq_len == len(PROMPT) + 1
