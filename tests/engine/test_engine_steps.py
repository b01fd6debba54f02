"""A chained pass of several steps, on the engine itself (in this process, over the tiny Llama's real runner): it
ends where single steps end, crossing pages and committing them; it is all or nothing when a batch fails in the
middle; its context can go away under it; and malformed requests are refused."""

from __future__ import annotations

import asyncio

import pytest
from engine_harness import PAGES, PROMPT, Engine, run
from pie_workers.runner import ModelRunner, RunnerSettings


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES))


def test_one_pass_of_many_steps_ends_where_single_steps_end(runner):
    """40 steps from a 29-token prompt cross three page boundaries; the pass commits its full pages when it ends."""

    async def body(e: Engine):
        one_by_one, first = await e.prefilled(PROMPT)
        tokens = [first]
        for step in range(40):
            [_, walk, seq_len, _] = await e.forward(one_by_one, [], len(PROMPT) + step, chained=[])
            tokens += walk
        chained_before = e.engine.chained_passes
        at_once, _ = await e.prefilled(PROMPT)
        [slots, walk, seq_len_at_once, _] = await e.forward(at_once, [], len(PROMPT), chained=[], steps=40)
        views = [e.engine.contexts.view(c) for c in (one_by_one, at_once)]
        continuation = [await e.forward(c, [], len(PROMPT) + 40, chained=[]) for c in (one_by_one, at_once)]
        for c in (one_by_one, at_once):
            await e.call("destroy", c)
        chained, store = e.engine.chained_passes - chained_before, e.engine.store.stats()
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
        while e.engine.chained_passes < 5:
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
