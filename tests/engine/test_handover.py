"""Contexts and snapshots move between replicas with their KV pages (``engine/handover.py``, ``transfer.py``): what
a leaving engine hands another continues there with the same logits and tokens as if it had never moved, without a
single pass recomputing it; a handover the other pool cannot take changes nothing, and the source serves on.

Two engines in this process, each over its own real runner of the tiny Llama (its own KV pool), driven as the
channel drives them (``engine_harness``); the leaving one reaches the other's ``adopt`` as it would its rank-0 actor.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pie_workers.engine.handover import ReplicaMoved
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import Slot, SlotKind
from pie_workers.wire.codec import slot_to_wire
from pie_workers.wire.messages import Claim, ContextReply, decode, encode
from support.engine_harness import PAGES, PROMPT, SAMPLER, SESSION, Engine

LOGITS = slot_to_wire(Slot(SlotKind.LOGITS))
STEPS = 12


@pytest.fixture(scope="module")
def other_runner(tiny_llama):
    """The replica the contexts move to: a pool of its own."""
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES))


def reached(engine: Engine) -> SimpleNamespace:
    """``engine`` as a leaving engine reaches the rank-0 actor of the replica taking over: ``adopt.remote``."""
    return SimpleNamespace(
        adopt=SimpleNamespace(remote=lambda h: asyncio.ensure_future(engine.engine.handovers.adopt(h)))
    )


async def decode_steps(e: Engine, ctx: int, token: int, position: int) -> list:
    """``STEPS`` steps, each on the token the one before sampled: every step's sampled token and logits."""
    out = []
    for i in range(STEPS):
        [slots, _, _, _] = await e.forward(ctx, [token], position + i, slots=[[0, SAMPLER], [0, LOGITS]])
        out.append(slots)
        token = slots[0][1]
    return out


def both(runner, other, body):
    async def main():
        a, b = Engine(runner), Engine(other)
        try:
            return await body(a, b)
        finally:
            a.stop()
            b.stop()

    return asyncio.run(main())


def test_a_context_a_fork_and_a_snapshot_continue_on_the_other_replica_as_if_they_never_moved(runner, other_runner):
    async def body(a: Engine, b: Engine):
        ctx, first = await a.prefilled(PROMPT)  # 29 tokens: a committed page and a working one
        twin = decode(ContextReply, await a.call("fork", ctx)).ctx
        await a.call("save", ctx, "before")
        expected = await decode_steps(a, twin, first, len(PROMPT))  # never moved: the reference

        adopted = await a.engine.handovers.leave(reached(b), ["ipc://elsewhere"])

        assert sorted(adopted.contexts) == [(SESSION, ctx), (SESSION, twin)] and not adopted.refused
        assert adopted.snapshots == [("alice", "before")]
        with pytest.raises(ReplicaMoved, match="moved to ipc://elsewhere"):
            await a.call("fork", ctx)
        stats = await a.engine.stats()
        assert (stats.contexts, stats.snapshots, stats.moved_out) == (0, 0, 3)
        assert stats.free + stats.cached == stats.total, "the source gave back every page it held"

        passes = b.engine.scheduler.requests_served
        [moved, moved_twin, unknown] = await b.call("claim", [encode(Claim(ctx)), encode(Claim(twin, 0)), {"ctx": 99}])
        assert unknown is None
        moved, moved_twin = decode(ContextReply, moved), decode(ContextReply, moved_twin)
        assert moved.seq_len == len(PROMPT) and moved_twin.seq_len == len(PROMPT) + STEPS
        assert len(moved_twin.tail) == len(PROMPT) + STEPS, "claimed with its tokens from known = 0 on"
        assert b.engine.scheduler.requests_served == passes, "nothing was recomputed: the KV came as pages"

        got = await decode_steps(b, moved.ctx, first, len(PROMPT))
        assert got == expected, "the same logits and tokens as the context that never moved"
        opened = decode(ContextReply, await b.call("open", "before"))
        assert await decode_steps(b, opened.ctx, first, len(PROMPT)) == expected
        assert await b.call("claim", [encode(Claim(ctx))]) == [None], "a context is claimed once"
        stats = await b.engine.stats()
        assert (stats.moved_in, stats.claimed) == (3, 2)

    both(runner, other_runner, body)


def test_a_claim_that_is_not_a_claim_is_refused_by_name(runner, other_runner):
    async def body(a: Engine, b: Engine):
        with pytest.raises(ValueError, match=r"malformed Claim: unknown fields \['bogus'\]"):
            await b.call("claim", [{"ctx": 1, "bogus": 2}])
        with pytest.raises(ValueError, match="list of Claim records"):
            await b.call("claim", {"ctx": 1})

    both(runner, other_runner, body)


def test_a_handover_the_other_pool_cannot_take_changes_nothing(runner, tiny_llama):
    other = ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES, page_size=32))

    async def body(a: Engine, b: Engine):
        ctx, first = await a.prefilled(PROMPT)
        twin = decode(ContextReply, await a.call("fork", ctx)).ctx
        expected = await decode_steps(a, twin, first, len(PROMPT))
        with pytest.raises(ValueError, match="cannot be installed"):
            await a.engine.handovers.leave(reached(b), ["ipc://elsewhere"])
        assert not a.engine.handovers.leaving
        assert await decode_steps(a, ctx, first, len(PROMPT)) == expected, "the source serves on, as it was"
        assert (await b.engine.stats()).contexts == 0

    both(runner, other, body)
