"""Steps run ahead: a plain step that asks for it has the next step run before it is asked for; a request that
repeats that step is answered from it, and anything else on the context drops it. Either way tokens, KV,
``seq_len``, buffer and pages end exactly as without it.

Two levels. On the engine itself (in this process, over the tiny Llama's real runner, through ``engine_harness``):
taking, dropping and withdrawing the step ahead, and refusing malformed requests. Through the SDK on a served
replica (every test on the torch and the vllm backend): stepping with ``async for`` has each plain step ask for the
next one ahead and the next step take it, whether the loop runs to its end, breaks early, or appends to the context
between steps.
"""

from __future__ import annotations

import asyncio

import pytest
from inferlet import Context, Model, Sampler
from pie_workers.wire.batch import Slot, SlotKind
from pie_workers.wire.codec import slot_to_wire
from support.engine_harness import PROMPT, SAMPLER, Engine, run
from support.sdk_host import each_backend

served = each_backend()  # the SDK tests below run on the torch and the vllm backend; the engine tests use ``runner``

ENTROPY = slot_to_wire(Slot(SlotKind.ENTROPY))
PROMPT_TEXT = "Count the rivers: one blue, two blue, three"

# On the engine itself


async def ran_ahead(e: Engine, ctx: int) -> None:
    """Until the context's step run ahead (if any) has its output."""
    while (state := e.engine.records.get(ctx)) is not None and state.ahead is not None and state.ahead.out is None:
        await asyncio.sleep(0)


def shape(e: Engine, ctx: int) -> tuple[int, int, int]:
    view = e.engine.contexts.view(ctx)
    return view.seq_len, view.committed_pages, view.working_pages


def test_steps_run_ahead_are_taken_and_end_where_plain_steps_end(runner):
    """40 steps from a 29-token prompt cross three page boundaries; every third request comes only after the step
    ahead of it has run, the others while it is queued or running."""

    async def body(e: Engine):
        runs = {}
        for ahead in (None, []):
            ctx, first = await e.prefilled(PROMPT)
            tokens = [first]
            for step in range(40):
                if ahead is not None and step % 3 == 2:
                    await ran_ahead(e, ctx)
                [slots, _, seq_len, _] = await e.forward(ctx, [tokens[-1]], len(PROMPT) + step, ahead=ahead)
                tokens.append(slots[0][1])
            runs[ahead is not None] = ctx, tokens, seq_len, shape(e, ctx)
        counts = e.engine.passes.steps.steps_ahead, e.engine.passes.steps.steps_ahead_taken
        continuation = [await e.forward(c, [runs[a][1][-1]], len(PROMPT) + 40) for a, (c, *_) in runs.items()]
        taken_by_continuation = e.engine.passes.steps.steps_ahead_taken - counts[1]
        for ctx, *_ in runs.values():
            await e.call("destroy", ctx)
        return runs, counts, continuation, taken_by_continuation, e.engine.store.stats()

    runs, counts, continuation, taken_by_continuation, store = run(runner, body)
    (_, plain, plain_len, plain_shape), (_, ahead, ahead_len, ahead_shape) = runs[False], runs[True]
    assert ahead == plain and ahead_len == plain_len == len(PROMPT) + 40
    assert ahead_shape == plain_shape, "same length, committed and working pages"
    assert counts == (40, 39), "each step ran the next one ahead, and the next request took it"
    assert taken_by_continuation == 1, "a request that did not ask for it still takes the step run ahead"
    assert continuation[0][0] == continuation[1][0], "the KV is the same"
    assert store.working == store.committed == 0, "every page is back in the pool (or cached, unreferenced)"


async def _differ_by_another_token(e, ctx, first, token, position):
    return await e.forward(ctx, [token, 7], position)


async def _differ_by_probes(e, ctx, first, token, position):
    return await e.forward(ctx, [token], position, slots=[[0, SAMPLER], [0, ENTROPY]])


async def _truncate_and_redo(e, ctx, first, token, position):
    """The same request as the dropped step ahead comes after a truncate and a redo: it must run afresh."""
    await e.call("truncate", ctx, 1)
    [slots, _, _, _] = await e.forward(ctx, [first], position - 1)
    assert slots[0][1] == token
    return await e.forward(ctx, [token], position)


async def _fork(e, ctx, first, token, position):
    child = (await e.call("fork", ctx))["ctx"]
    await e.call("destroy", child)
    return await e.forward(ctx, [token], position)


async def _snapshot(e, ctx, first, token, position):
    await e.call("delete", await e.call("snapshot", ctx))
    return await e.forward(ctx, [token], position)


async def _suspend(e, ctx, first, token, position):
    await e.call("suspend", ctx)
    return await e.forward(ctx, [token], position)


async def _suspended_by_memory_pressure(e, ctx, first, token, position):
    """The residency suspends a context between operations, without taking its turn: it waits for the step ahead."""
    e.engine.residency.suspend_or_defer(e.engine.records.get(ctx))
    return await e.forward(ctx, [token], position)


async def _suspended_then_snapshot(e, ctx, first, token, position):
    """A snapshot restores a suspended context (its pages, not the step ahead's KV)."""
    e.engine.residency.suspend_or_defer(e.engine.records.get(ctx))
    await ran_ahead(e, ctx)
    await e.call("delete", await e.call("snapshot", ctx))
    return await e.forward(ctx, [token], position)


@pytest.mark.parametrize(
    "between",
    [
        _differ_by_another_token,
        _differ_by_probes,
        _truncate_and_redo,
        _fork,
        _snapshot,
        _suspend,
        _suspended_by_memory_pressure,
        _suspended_then_snapshot,
    ],
)
def test_anything_else_drops_the_step_ahead(runner, between):
    """The step runs ahead into a page of its own (the context is 32 tokens long, its last token held back from
    commit, so that it can be truncated): dropping it gives the page back, and whatever comes next gives what it
    gives on a context that never ran a step ahead."""

    async def body(e: Engine):
        prompt = PROMPT + [11, 12]  # 31 tokens; the step makes 32, a full second page
        runs = {}
        for ahead in (None, []):
            ctx, first = await e.prefilled(prompt)
            [slots, _, _, _] = await e.forward(ctx, [first], len(prompt), ahead=ahead, hold=1)
            taken = e.engine.passes.steps.steps_ahead_taken
            answer = await between(e, ctx, first, slots[0][1], len(prompt) + 1)
            taken = e.engine.passes.steps.steps_ahead_taken - taken
            [after, _, _, _] = await e.forward(ctx, [answer[0][0][1]], answer[2])  # reads the KV written so far
            runs[ahead is not None] = answer, shape(e, ctx), taken, after
            await e.call("destroy", ctx)
        return runs, e.engine.passes.steps.steps_ahead, e.engine.store.stats()

    runs, steps_ahead, store = run(runner, body)
    (plain, plain_shape, _, plain_after), (answer, ahead_shape, taken, after) = runs[False], runs[True]
    assert steps_ahead == 1 and taken == 0, "the step ran ahead and nobody took it"
    assert answer[0] == plain[0] and answer[2] == plain[2], "the same output and seq_len"
    assert ahead_shape == plain_shape, "the step ahead's page went back"
    assert after == plain_after, "the same KV"
    assert store.working == store.committed == 0


def test_no_step_runs_ahead_of_a_stop_id(runner):
    async def body(e: Engine):
        ctx, first = await e.prefilled(PROMPT)
        [slots, _, _, _] = await e.forward(ctx, [first], len(PROMPT))
        await e.call("truncate", ctx, 1)
        stop = slots[0][1]
        await e.forward(ctx, [first], len(PROMPT), ahead=[stop])
        await e.forward(ctx, [stop], len(PROMPT) + 1, ahead=[stop + 1])
        return e.engine.passes.steps.steps_ahead

    assert run(runner, body) == 1, "only the step that did not sample a stop id ran the next one ahead"


def test_destroying_a_context_while_its_step_runs_ahead(runner):
    """The step ahead, still queued, is withdrawn with the context: a page it would write may go to another context
    at once. The engine serves on and every page comes back. (Two contexts prefill in one batch, so the scheduler
    holds the next batches open for a second request: the step ahead is still queued when the test sees its step's
    answer.)"""

    async def body(e: Engine):
        (ctx, first), (other, token) = await asyncio.gather(e.prefilled(PROMPT), e.prefilled(PROMPT))
        await e.forward(ctx, [first], len(PROMPT), ahead=[])
        queued = e.engine.scheduler.queued
        await e.call("destroy", ctx)
        queued_after = e.engine.scheduler.queued
        [_, _, seq_len, _] = await e.forward(other, [token], len(PROMPT), ahead=[])
        await e.call("destroy", other)
        return queued, queued_after, seq_len, e.engine.store.stats()

    queued, queued_after, seq_len, store = run(runner, body)
    assert queued == 1 and queued_after == 0, "the step ahead was queued, and was withdrawn"
    assert seq_len == len(PROMPT) + 1
    assert store.working == store.committed == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chained": [], "ahead": []}, "only a plain pass of one step"),
        ({"ahead": 3}, "stop_ids must be a list of token ids, got 3"),
    ],
)
def test_malformed_ahead_requests_are_refused(runner, kwargs, message):
    async def body(e: Engine):
        ctx, first = await e.prefilled(PROMPT)
        tokens = [] if "chained" in kwargs else [first]
        with pytest.raises(ValueError, match=message):
            await e.forward(ctx, tokens, len(PROMPT), **kwargs)
        [_, _, seq_len, _] = await e.forward(ctx, [first], len(PROMPT))
        return seq_len

    assert run(runner, body) == len(PROMPT) + 1


# Through the SDK on a served replica


async def one_at_a_time(ctx: Context, n: int, append_after: int | None = None) -> list[int]:
    """The reference: n generations of one token each (a single pass each: no chaining, nothing run ahead)."""
    tokens: list[int] = []
    for i in range(n):
        tokens += await ctx.generate(Sampler.argmax(), max_tokens=1, stop=[], auto_flush=False).collect_tokens()
        if i + 1 == append_after:
            ctx.append([42])
    return tokens


async def stepping(ctx: Context, n: int, append_after: int | None = None, break_after: int | None = None):
    tokens: list[int] = []
    async for step in ctx.generate(Sampler.argmax(), max_tokens=n, stop=[], auto_flush=False):
        tokens += (await step.execute()).tokens
        if len(tokens) == append_after:
            ctx.append([42])
        if len(tokens) == break_after:
            break
    return tokens


async def continuation(ctx: Context) -> list[int]:
    return await ctx.generate(Sampler.argmax(), max_tokens=6, stop=[], auto_flush=False).collect_tokens()


def _compare(served, n: int, **how) -> tuple:
    """Run the reference and stepping on two forks of one prompt; returns both runs' (tokens, seq_len, buffer,
    continuation), the steps run ahead and taken meanwhile, and the replica's pages once the inferlet ended."""

    async def main(input):
        model = Model.load("default")
        with Context(model) as base:
            base.user(PROMPT_TEXT)
            await base.flush()
            base.append([7])
            plain, ahead = base.fork(), base.fork()
            reference = await one_at_a_time(plain, how.get("break_after") or n, how.get("append_after"))
            before = served.stats()
            got = await stepping(ahead, n, **how)
            after = served.stats()
            counts = after.ahead - before.ahead, after.ahead_taken - before.ahead_taken
            runs = [(t, c.seq_len, c.buffer(), await continuation(c)) for t, c in ((reference, plain), (got, ahead))]
            return runs, counts

    runs, counts = served.run(main)
    stats = served.stats()
    return runs, counts, (stats.working, stats.contexts)


def test_stepping_takes_the_steps_run_ahead(served):
    runs, (ran, taken), pages = _compare(served, 24)
    assert runs[1] == runs[0] and len(runs[1][0]) == 24
    assert ran == taken == 23, "every step but the last ran the next one ahead, and the next step took it"
    assert pages == (0, 0)


def test_breaking_out_of_the_loop_leaves_the_context_as_single_steps_do(served):
    runs, (ran, taken), pages = _compare(served, 24, break_after=5)
    assert runs[1] == runs[0] and len(runs[1][0]) == 5
    assert ran == 5 and taken == 4, "the step run ahead of the break was dropped"
    assert pages == (0, 0), "its page too"


def test_appending_between_steps_drops_the_step_ahead(served):
    runs, (ran, taken), pages = _compare(served, 12, append_after=4)
    assert runs[1] == runs[0] and len(runs[1][0]) == 12
    assert ran == 11 and taken == 10, "the step after the append ran afresh"
    assert pages == (0, 0)
