"""Chained steps: the collectors send step k + 1 before step k's output is back, and must end exactly where stepping
one by one ends — tokens, ``seq_len``, buffer and KV — whether generation stops, fails or is cancelled."""

from __future__ import annotations

import asyncio
import contextlib

from conftest import each_backend
from inferlet import Context, Model, Sampler
from pie_workers.wire.messages import PassKind, PassRequest, encode

served = each_backend()  # every test here runs on the torch and the vllm backend

PROMPT = "Count the rivers: one blue, two blue, three"


async def step_by_step(gen) -> list[int]:
    """The reference: the Generator's plain stepping, which never chains."""
    tokens: list[int] = []
    async for step in gen:
        tokens += (await step.execute()).tokens
    return tokens


async def continuation(ctx: Context, n: int = 6) -> list[int]:
    """What the context generates next (from token 42 if nothing is buffered): equal continuations mean equal KV
    and buffer."""
    if not ctx.buffer():
        ctx.append([42])
    return await ctx.generate(Sampler.argmax(), max_tokens=n, stop=[], auto_flush=False).collect_tokens()


async def both_ways(base: Context, chained_passes, **generate) -> tuple:
    """Generate from two forks of ``base``, stepping one by one and collecting; returns (stepped tokens, collected
    tokens, passes the replica chained meanwhile, each fork's (seq_len, buffer), each fork's continuation)."""
    plain, chained = base.fork(), base.fork()
    expect = await step_by_step(plain.generate(Sampler.argmax(), **generate))
    before = chained_passes()
    got = await chained.generate(Sampler.argmax(), **generate).collect_tokens()
    passes = chained_passes() - before
    states = [(c.seq_len, c.buffer()) for c in (plain, chained)]
    return expect, got, passes, states, [await continuation(c) for c in (plain, chained)]


def test_collect_chains_steps_and_ends_where_stepping_one_by_one_ends(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as base:
            base.user(PROMPT)
            await base.flush()
            return await both_ways(base, lambda: served.stats()["chained"], max_tokens=12, stop=[])

    expect, got, passes, states, after = served.run(main)
    assert got == expect and len(got) == 12
    assert passes == 11, "every step after the first rides on its predecessor's token"
    assert states[0] == states[1] and len(states[0][1]) == 1, "the last token waits in the buffer"
    assert after[0] == after[1]


def test_a_stop_token_skips_the_chained_pass(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as base:
            base.user(PROMPT)
            free = await base.fork().generate(Sampler.argmax(), max_tokens=10, stop=[]).collect_tokens()
            return free, *await both_ways(base, lambda: served.stats()["chained"], stop=[free[5]])

    free, expect, got, passes, states, after = served.run(main)
    cut = free.index(free[5])
    assert got == expect == free[:cut]
    assert passes == cut, "the pass chained on the stop token never ran"
    assert states[0] == states[1] and states[1][1] == [], "the stop token is neither kept nor in the KV"
    assert after[0] == after[1]


def test_an_early_return_or_cancellation_leaves_the_context_as_plain_stepping_does(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as base:
            base.user(PROMPT)
            await base.flush()
            start = base.seq_len
            base.append([42])  # each generation below starts from this buffered token
            reference = (
                await base.fork().generate(Sampler.argmax(), max_tokens=40, stop=[], auto_flush=False).collect_tokens()
            )

            early = base.fork()  # as collect_text returning at a Done event; here, at the third token
            gen = early.generate(Sampler.argmax(), max_tokens=40, stop=[], auto_flush=False)
            seen: list[int] = []

            def take(out):
                seen.extend(out.tokens)
                return len(seen) == 3

            await gen.drain(take)
            early_state = early.seq_len - start, early.buffer()

            cancelled = base.fork()
            task = asyncio.ensure_future(
                cancelled.generate(Sampler.argmax(), max_tokens=40, stop=[], auto_flush=False).collect_tokens()
            )
            while cancelled.seq_len < start + 8:
                await asyncio.sleep(0.001)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            k = cancelled.seq_len - start  # tokens generated: the KV holds token 42 and all of them but the last
            cancelled_state = k, cancelled.buffer(), await continuation(cancelled)
            return reference, early_state, await continuation(early), cancelled_state

    reference, early_state, early_next, (k, buffer, cancelled_next) = served.run(main)
    assert early_state == (3, [reference[2]])
    assert early_next == reference[3:9]
    assert 8 < k < 40 and buffer == [reference[k - 1]]
    assert cancelled_next == reference[k : k + 6]


def test_a_failed_step_fails_the_chained_one_and_restores_the_buffer(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.user("fine so far")
            await ctx.flush()
            seq_len = ctx.seq_len
            ctx.append([999999])  # out of the vocabulary: the first step fails, and the one chained on it
            try:
                await ctx.generate(Sampler.argmax(), max_tokens=5, stop=[], auto_flush=False).collect_tokens()
            except ValueError as e:
                return str(e), ctx.seq_len == seq_len, ctx.buffer()

    error, kv_unchanged, buffer = served.run(main)
    assert "out of the vocabulary" in error
    assert kv_unchanged and buffer == [999999]
    stats = served.stats()
    assert stats["working"] == 0 and stats["contexts"] == 0


def test_a_chained_pass_needs_a_predecessor_that_sampled(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.user("no pass yet")
            await ctx.flush()  # a pass that samples nothing
            errors = []
            for tokens in ([], [5]):
                request = PassRequest(ctx.id, kind=PassKind.CHAINED, tokens=tokens, positions=[ctx.seq_len])
                try:
                    await model.channel.call("forward", encode(request))
                except ValueError as e:
                    errors.append(str(e))
            return errors

    errors = served.run(main)
    assert "failed or sampled no token" in errors[0]
    assert "send no tokens" in errors[1]
