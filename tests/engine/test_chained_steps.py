"""Chained steps: a pass that runs on its predecessor's sampled token, sent before that token is back. Chained
passes must end exactly where stepping one by one ends (tokens, ``seq_len``, buffer, KV and pages), whether
generation runs to its end, stops, fails or is cancelled.

Two levels. On the engine itself (in this process, over the tiny Llama's real runner, through ``engine_harness``):
a chained pass of several steps ends where single steps end, crossing pages and committing them; it is all or
nothing when a batch fails in the middle; its context can go away under it; and malformed requests are refused.
Through the SDK on a served replica (every test on the torch and the vllm backend): the Generator's collectors
chain step k + 1 onto step k and end where its plain stepping ends.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from inferlet import Context, Model, Sampler
from support.engine_harness import PROMPT, Engine, run
from support.sdk_host import each_backend

served = each_backend()  # the SDK tests below run on the torch and the vllm backend; the engine tests use ``runner``

PROMPT_TEXT = "Count the rivers: one blue, two blue, three"

# On the engine itself


def test_one_pass_of_many_steps_ends_where_single_steps_end(runner):
    """40 steps from a 29-token prompt cross three page boundaries; the pass commits its full pages when it ends."""

    async def body(e: Engine):
        one_by_one, first = await e.prefilled(PROMPT)
        tokens = [first]
        for step in range(40):
            [_, walk, seq_len, _] = await e.forward(one_by_one, [], len(PROMPT) + step, chained=[])
            tokens += walk
        chained_before = e.engine.passes.steps.chained_passes
        at_once, _ = await e.prefilled(PROMPT)
        [slots, walk, seq_len_at_once, _] = await e.forward(at_once, [], len(PROMPT), chained=[], steps=40)
        views = [e.engine.contexts.view(c) for c in (one_by_one, at_once)]
        continuation = [await e.forward(c, [], len(PROMPT) + 40, chained=[]) for c in (one_by_one, at_once)]
        for c in (one_by_one, at_once):
            await e.call("destroy", c)
        chained, store = e.engine.passes.steps.chained_passes - chained_before, e.engine.store.stats()
        return tokens, [first, *walk], slots, (seq_len, seq_len_at_once), chained, views, continuation, store

    tokens, at_once, slots, (seq_len, seq_len_at_once), chained, views, continuation, store = run(runner, body)
    assert at_once == tokens and len(at_once) == 41
    assert slots[0][1] == at_once[-1], "the answer carries the last step's slots"
    assert seq_len_at_once == seq_len == len(PROMPT) + 40
    assert chained == 40 + 2, "each step ran chained (and both continuations)"
    assert views[1].committed_pages == (len(PROMPT) + 40) // 16 == views[0].committed_pages
    assert continuation[0][1] == continuation[1][1], "the KV is the same"
    assert store.working == store.committed == 0, "every page is back in the pool (or cached, unreferenced)"


def test_a_stop_id_ends_the_pass_after_the_step_that_sampled_it(runner):
    async def body(e: Engine):
        free, first = await e.prefilled(PROMPT)
        [_, walk, _, _] = await e.forward(free, [], len(PROMPT), chained=[], steps=12)
        stop = next(t for t in walk[3:] if t != first)  # the pass's input must not be the stop id already
        ctx, _ = await e.prefilled(PROMPT)
        ended = await e.forward(ctx, [], len(PROMPT), chained=[stop], steps=12)
        skipped = await e.forward(ctx, [], len(PROMPT) + len(ended[1]), chained=[stop], steps=12)
        return walk, stop, ended, skipped

    walk, stop, [_, got, seq_len, _], skipped = run(runner, body)
    cut = walk.index(stop) + 1
    assert got == walk[:cut], "the walk ends with the stop id"
    assert seq_len == len(PROMPT) + cut, "each step wrote its input: the stop id itself is not in the KV"
    assert skipped is None, "a pass chained on a stop id never runs"


def test_a_batch_that_fails_midway_undoes_the_pass(runner, monkeypatch):
    """The runner fails the pass's fourth batch: the three steps before are undone (KV, lineage, pages), the error
    reaches the caller, a pass chained on it fails, and the engine serves on."""

    async def body(e: Engine):
        ctx, _ = await e.prefilled(PROMPT)
        before = e.engine.contexts.view(ctx)
        execute, batches = runner.execute, []

        def failing_fourth(batch):
            batches.append(batch)
            if len(batches) == 4:
                raise RuntimeError("device lost")
            return execute(batch)

        monkeypatch.setattr(runner, "execute", failing_fourth)
        with pytest.raises(RuntimeError, match="device lost"):
            await e.forward(ctx, [], len(PROMPT), chained=[], steps=10)
        after = e.engine.contexts.view(ctx)
        with pytest.raises(ValueError, match="failed or sampled no token"):
            await e.forward(ctx, [], len(PROMPT), chained=[], steps=10)
        monkeypatch.setattr(runner, "execute", execute)
        again = await e.forward(ctx, [1, 2, 3], len(PROMPT))
        return before, after, again

    before, after, again = run(runner, body)
    assert after == before, "no token, page or commit of the failed pass remains"
    assert again[2] == len(PROMPT) + 3


def test_destroying_the_context_midway_fails_the_pass_and_frees_its_pages(runner):
    async def body(e: Engine):
        ctx, _ = await e.prefilled(PROMPT)
        running = e.forward(ctx, [], len(PROMPT), chained=[], steps=30)
        while e.engine.passes.steps.chained_passes < 5:
            await asyncio.sleep(0)
        await e.call("destroy", ctx)
        with pytest.raises(ValueError, match=f"context {ctx} was destroyed"):
            await running
        other, _ = await e.prefilled(PROMPT)
        [_, walk, _, _] = await e.forward(other, [], len(PROMPT), chained=[], steps=3)
        await e.call("destroy", other)
        return walk, e.engine.store.stats()

    walk, store = run(runner, body)
    assert len(walk) == 3
    assert store.working == store.committed == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 3}, "a chained pass one or more: got 3 steps"),
        ({"chained": [], "steps": 0}, "got 0 steps"),
        ({"chained": [], "steps": "3"}, "got '3' steps"),
    ],
)
def test_malformed_step_counts_are_refused(runner, kwargs, message):
    async def body(e: Engine):
        ctx, _ = await e.prefilled(PROMPT)
        tokens = [] if "chained" in kwargs else [5]
        with pytest.raises(ValueError, match=message):
            await e.forward(ctx, tokens, len(PROMPT), **kwargs)
        [_, _, seq_len, _] = await e.forward(ctx, [5], len(PROMPT))
        return seq_len

    assert run(runner, body) == len(PROMPT) + 1


@pytest.mark.parametrize(
    ("sampler", "message"),
    [
        ([99, 1.0, 0, 1.0, 0.0, 0, [], -1], "unknown sampler kind code 99"),
        ([0, [1.0], 0, 1.0, 0.0, 0, [], -1], "malformed sampler on the wire"),
        ([0, 1.0, 0, 1.0, 0.0, 0, []], "malformed sampler on the wire"),
    ],
)
def test_malformed_samplers_are_refused(runner, sampler, message):
    async def body(e: Engine):
        ctx, _ = await e.prefilled(PROMPT)
        with pytest.raises(ValueError, match=message):
            await e.forward(ctx, [5], len(PROMPT), sampler=sampler)
        [_, _, seq_len, _] = await e.forward(ctx, [5], len(PROMPT))
        return seq_len

    assert run(runner, body) == len(PROMPT) + 1


def test_a_chained_pass_needs_a_predecessor_that_sampled(runner):
    """A pass chained on one that sampled nothing is refused, and so is a chained pass that sends tokens."""

    async def body(e: Engine):
        ctx = await e.call("create")
        await e.forward(ctx, PROMPT, 0, slots=[])  # a pass that samples nothing, as a flush sends
        errors = []
        for tokens in ([], [5]):
            with pytest.raises(ValueError) as refused:
                await e.forward(ctx, tokens, len(PROMPT), chained=[], slots=[])
            errors.append(str(refused.value))
        return errors

    errors = run(runner, body)
    assert "failed or sampled no token" in errors[0]
    assert "send no tokens" in errors[1]


# Through the SDK on a served replica


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
            base.user(PROMPT_TEXT)
            await base.flush()
            return await both_ways(base, lambda: served.stats().chained, max_tokens=12, stop=[])

    expect, got, passes, states, after = served.run(main)
    assert got == expect and len(got) == 12
    assert passes == 11, "every step after the first rides on its predecessor's token"
    assert states[0] == states[1] and len(states[0][1]) == 1, "the last token waits in the buffer"
    assert after[0] == after[1]


def test_a_stop_token_skips_the_chained_pass(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as base:
            base.user(PROMPT_TEXT)
            free = await base.fork().generate(Sampler.argmax(), max_tokens=10, stop=[]).collect_tokens()
            return free, *await both_ways(base, lambda: served.stats().chained, stop=[free[5]])

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
            base.user(PROMPT_TEXT)
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
    assert stats.working == 0 and stats.contexts == 0
