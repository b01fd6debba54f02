"""Steps run ahead, on the engine itself (in this process, over the tiny Llama's real runner): a plain step that
asks for it has the next step run before it is asked for; a request that repeats that step is answered from it, and
anything else on the context drops it. Either way tokens, KV, ``seq_len`` and pages end exactly as without it."""

from __future__ import annotations

import asyncio

import pytest
from engine_harness import PAGES, PROMPT, SAMPLER, Engine, run
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import Slot, SlotKind
from pie_workers.wire.codec import slot_to_wire

ENTROPY = slot_to_wire(Slot(SlotKind.ENTROPY))


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES))


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
        counts = e.engine.steps_ahead, e.engine.steps_ahead_taken
        continuation = [await e.forward(c, [runs[a][1][-1]], len(PROMPT) + 40) for a, (c, *_) in runs.items()]
        taken_by_continuation = e.engine.steps_ahead_taken - counts[1]
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
            taken = e.engine.steps_ahead_taken
            answer = await between(e, ctx, first, slots[0][1], len(prompt) + 1)
            taken = e.engine.steps_ahead_taken - taken
            [after, _, _, _] = await e.forward(ctx, [answer[0][0][1]], answer[2])  # reads the KV written so far
            runs[ahead is not None] = answer, shape(e, ctx), taken, after
            await e.call("destroy", ctx)
        return runs, e.engine.steps_ahead, e.engine.store.stats()

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
        return e.engine.steps_ahead

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
