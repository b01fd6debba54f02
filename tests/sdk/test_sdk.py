"""The inferlet SDK end to end: inferlets against a real replica engine on Ray, checked against transformers."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from inferlet import Context, Logits, Model, Sampler
from inferlet._channel import ReplicaError
from pie_cluster.hosts.run import run_inferlet
from pie_workers.wire.pages import pages_for
from support.sdk_host import TRUST, each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend

STOPS = [2, 0]  # <|im_end|>, <|endoftext|>: the ChatML template's end-of-turn set


def hf_greedy(hf, messages: list[dict], n: int) -> list[int]:
    tok, model = hf
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=STOPS, pad_token_id=0)
    gen = out[0, len(ids) :].tolist()
    return gen[: next((i for i, t in enumerate(gen) if t in STOPS), len(gen))]


def prompt(i: int) -> str:
    rng = random.Random(i)
    return " ".join(
        rng.choice(["paged", "attention", "cache", "token", "model", "river", "blue", "seven"])
        for _ in range(3 + i % 7)
    )


async def greedy_chat(input: dict) -> list[int]:
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.system("You are terse.").user(input["prompt"])
        return await ctx.generate(Sampler.argmax(), max_tokens=input["n"]).collect_tokens()


def test_greedy_equals_hf_generate(served, hf):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt(0)}]
    assert served.run(greedy_chat, {"prompt": prompt(0), "n": 24}) == hf_greedy(hf, messages, 24)


def test_sixteen_concurrent_inferlets_each_equal_hf(served, hf):
    before = served.stats()
    results = served.run_many([(greedy_chat, {"prompt": prompt(i), "n": 16}) for i in range(16)])
    for i, got in enumerate(results):
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt(i)}]
        assert got == hf_greedy(hf, messages, 16), i
    after = served.stats()
    requests, batches = after.requests - before.requests, after.batches - before.batches
    assert requests / batches > 4, "concurrent inferlets should share batches"
    assert after.working == 0 and after.contexts == 0, "every page and context released"


CHILD_TURNS = ["Why?", "Explain the river model in seven blue tokens, please.", '{"json": [1, 2, 3]}']


def test_fork_shares_committed_pages_and_children_diverge(served, hf):
    async def main(input):
        model = Model.load("default")
        parent = Context(model)
        parent.system("You are terse. " * 6).user("Name three colors.")
        await parent.flush()
        base = await served_stats()
        children = [parent.fork() for _ in range(3)]
        forked = await served_stats()
        outs = []
        for i, child in enumerate(children):
            child.user(CHILD_TURNS[i])  # each child's own continuation
            outs.append(await child.generate(Sampler.argmax(), max_tokens=6).collect_tokens())
        for c in [parent, *children]:
            c.release()
        return base, forked, outs, parent.seq_len

    async def served_stats():
        return await served.replica.leader.engine_stats.remote()

    base, forked, outs, _ = served.run(main)
    assert base.committed >= 2
    assert forked.committed == base.committed, "children share the parent's committed pages"
    assert forked.working - base.working <= 3, "only the partly filled page is copied"
    for i, got in enumerate(outs):
        # child i's conversation is the parent's buffer + its own user turn; a fresh run of the same text agrees
        tok, _ = hf
        expected = hf_greedy_tokens(hf, "You are terse. " * 6, "Name three colors.", CHILD_TURNS[i], 6)
        assert got == expected, i
    assert len({tuple(o) for o in outs}) > 1, "children diverge"
    after = served.stats()
    assert after.working == 0 and after.committed == 0
    assert after.free + after.cached == after.total


def hf_greedy_tokens(hf, system: str, user1: str, user2: str, n: int) -> list[int]:
    """Greedy continuation of system + user1 + user2 turns (ChatML), computed by transformers."""
    tok, model = hf
    text = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user1}, {"role": "user", "content": user2}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=STOPS, pad_token_id=0)
    gen = out[0, len(ids) :].tolist()
    return gen[: next((i for i, t in enumerate(gen) if t in STOPS), len(gen))]


def test_truncate_then_redecode_matches_never_generated(served):
    async def main(input):
        model = Model.load("default")
        ctx = Context(model)
        ctx.user("Count: one two three four five six seven eight nine ten eleven")
        gen = await ctx.generate(Sampler.argmax(), max_tokens=10, stop=[]).collect_tokens()
        in_kv = ctx.seq_len
        k = min(4, in_kv % ctx.page_size)  # stay inside the working page (full pages are committed)
        assert k >= 1
        ctx.truncate(k)
        assert ctx.seq_len == in_kv - k
        redo = []
        nxt = gen[9 - k - 1 + 1 - 1]  # the first token whose KV was dropped
        for _ in range(k):
            fwd = ctx.forward()
            fwd.input([nxt])
            h = fwd.sample([0], Sampler.argmax())
            nxt = (await fwd.execute()).token(h)
            redo.append(nxt)
        with pytest.raises(ValueError, match="committed"):
            ctx.truncate(ctx.seq_len)
        return gen, redo, k

    gen, redo, k = served.run(main)
    assert redo == gen[10 - k :]


def test_stop_sets_add_and_max_tokens_is_exact(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.user(prompt(3))
            free_run = await ctx.fork().generate(Sampler.argmax(), max_tokens=8).collect_tokens()
            g = ctx.fork().generate(Sampler.argmax(), stop=[free_run[3]])
            stopped = await g.collect_tokens()
            exact = await ctx.fork().generate(Sampler.argmax(), max_tokens=5).collect_tokens()
            g2 = ctx.generate(Sampler.argmax(), stop=[12345 % 4096])
            templated = 2 in g2.state.stop and 0 in g2.state.stop
            return free_run, stopped, exact, templated

    free_run, stopped, exact, templated = served.run(main)
    assert stopped == free_run[: free_run.index(free_run[3])]
    assert exact == free_run[:5]
    assert templated, "custom stop ids add to the template's stop set"


def test_manual_accept_advances_max_tokens_and_stops(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.user("Pick tokens for me.")
            g = ctx.generate(Sampler.argmax(), max_tokens=3)
            chosen = []
            async for step in g:
                step.clear_sampler()
                h = step.probe(0, Logits())
                logits = (await step.execute()).logits(h)
                assert len(logits) == 4096 * 4
                tok = 100 + len(chosen)
                chosen += g.accept([tok])
            after_max = (g.tokens_generated, g.is_done)

            g2 = ctx.generate(Sampler.argmax(), max_tokens=50)
            async for step in g2:
                step.clear_sampler()
                await step.execute()
                kept = g2.accept([7, 2, 9])  # 2 = <|im_end|>: the template stop ends the turn, 9 is dropped
            return chosen, after_max, kept, g2.is_done, g2.tokens_generated

    chosen, after_max, kept, done, n = served.run(main)
    assert chosen == [100, 101, 102] and after_max == (3, True)
    assert kept == [7] and done and n == 1


def test_bad_input_raises_in_the_inferlet_and_the_replica_keeps_serving(served, hf):
    async def unknown_model(input):
        Model.load("no-such-model")

    async def misuse(input):
        model = Model.load("default")
        errors = {}
        assert Context.open(model, "never-saved") is None
        for name, action in {
            "delete": lambda: Context.delete(model, "never-saved"),
            "spec": lambda: Context(model).generate(Sampler.argmax(), speculator=object(), system_speculation=True),
        }.items():
            try:
                action()
            except ValueError as e:
                errors[name] = str(e)
        ctx = Context(model)
        ctx.release()
        try:
            ctx.user("hi")
        except ValueError as e:
            errors["released"] = str(e)
        live = Context(model)
        fwd = live.forward()
        fwd.input([999999])
        fwd.sample([0], Sampler.argmax())
        try:
            await fwd.execute()
        except ValueError as e:
            errors["vocab"] = str(e)
        live.user("still fine?")
        errors["after"] = await live.generate(Sampler.argmax(), max_tokens=3).collect_tokens()
        return errors

    with pytest.raises(ValueError, match="no-such-model"):
        served.run(unknown_model)
    results = served.run_many([(misuse, {}), (greedy_chat, {"prompt": prompt(5), "n": 8})])
    errors, other = results
    assert "never-saved" in errors["delete"]
    assert "mutually exclusive" in errors["spec"]
    assert "released" in errors["released"]
    assert "out of the vocabulary" in errors["vocab"]
    assert len(errors["after"]) == 3
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": prompt(5)}]
    assert other == hf_greedy(hf, messages, 8), "another inferlet is unaffected"
    stats = served.stats()
    assert stats.working == 0 and stats.contexts == 0


def test_a_new_context_reuses_cached_prefix_pages(served, hf):
    long_system = "You are a careful assistant who answers in one short sentence. " * 3

    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.system(long_system).user(input["q"])
            before = await served.replica.leader.engine_stats.remote()
            tokens = await ctx.generate(Sampler.argmax(), max_tokens=6).collect_tokens()
            after = await served.replica.leader.engine_stats.remote()
            return tokens, before, after

    first, _, _ = served.run(main, {"q": "Why is the sky blue?"})
    second, before, after = served.run(main, {"q": "Why is the sea salty?"})
    prompt_len = len(
        hf[0].apply_chat_template(
            [{"role": "system", "content": long_system}, {"role": "user", "content": "Why is the sea salty?"}],
            add_generation_prompt=True,
        )["input_ids"]
    )
    without_reuse = pages_for(prompt_len + 5, 16)  # pages the prompt and 5 generated tokens fill in the KV cache
    fresh = before.free - after.free  # the pool is far from full: nothing is evicted to make room
    assert fresh <= without_reuse - 2, "at least the two pages of pure system prompt were adopted from the cache"
    messages = [{"role": "system", "content": long_system}, {"role": "user", "content": "Why is the sea salty?"}]
    assert second == hf_greedy(hf, messages, 6)


def test_a_model_that_fails_to_close_does_not_keep_the_others_contexts(served, tmp_path):
    """The inferlet ends holding contexts on two models, one whose replica is gone: the other's contexts are still
    released, and the failure is reported."""
    gone = dataclasses.replace(served.endpoints["default"], name="gone", address=f"ipc://{tmp_path}/no-replica")

    async def holds_both(input):
        Model.load("gone")  # loaded first, so closed first: its failure must not stop the rest
        Context(Model.load("default")).user("kept until the end")

    with pytest.raises(ReplicaError, match="cannot reach the replica"):
        asyncio.run(
            run_inferlet(holds_both, {}, {**served.endpoints, "gone": gone}, "alice", **TRUST.instance("alice"))
        )
    assert served.stats().contexts == 0


def test_an_ending_inferlet_releases_its_contexts_without_holding_the_event_loop(served):
    """Many inferlets share a host's loop: while the replica answers one's close (after releasing its contexts),
    the others run. A loop iteration passes between the inferlet's return and its runner's, and its contexts are
    gone by then."""
    turns: list[int] = []
    marks: dict[str, int] = {}

    async def ticking():
        while "done" not in marks:
            turns.append(1)
            await asyncio.sleep(0)

    async def holder(input):
        ctx = Context(Model.load("default"))  # left open: the runtime's close releases it
        ctx.user("held until the end")
        await ctx.flush()
        marks["returned"] = len(turns)
        return "ok"

    async def both():
        ticker = asyncio.get_running_loop().create_task(ticking())
        await asyncio.sleep(0)
        got = await run_inferlet(holder, {}, served.endpoints, "alice", **TRUST.instance("alice"))
        marks["closed"], marks["done"] = len(turns), True
        await ticker
        return got

    assert asyncio.run(both()) == "ok"
    assert marks["closed"] > marks["returned"]
    assert served.stats().contexts == 0
