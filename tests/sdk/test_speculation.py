"""Speculative decoding: drafts verified in the replica's batch never change what a Generator produces.

The reference for every case is the same generation without drafts. An ``Oracle`` speculator proposes that run's
tokens (so every draft should be accepted); the runtime's n-gram drafter (``system_speculation``) guesses from the
context's own text. Consistency after a cut inside accepted drafts is checked by continuing generation in the same
context and comparing with the run that never drafted.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from inferlet import Context, Model, Regex, Sampler
from pie_workers.engine.ngram import draft
from support.sdk_host import each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend

PROMPT = "Count: one two three, one two three, one two three, one two three,"
DIGITS = "[0-9]{3}-[0-9]{3}-[0-9]{4}"


class Oracle:
    """Proposes ``truth`` (a run without drafts) ``k`` tokens at a time, and records what it is told."""

    def __init__(self, ctx: Context, truth: list[int], k: int, corrupt_at: int | None = None, corrupt_with=None):
        self.ctx, self.truth, self.k = ctx, truth, k
        self.corrupt_at, self.corrupt_with = corrupt_at, corrupt_with
        self.produced = 0
        self.accepted_drafts = 0
        self.rolled_back = 0
        self.page_crossings = 0

    def draft(self) -> tuple[list[int], list[int]]:
        tokens = self.truth[self.produced : self.produced + self.k]
        if self.corrupt_at is not None and self.produced <= self.corrupt_at < self.produced + len(tokens):
            tokens[self.corrupt_at - self.produced] = self.corrupt_with
        first = self.ctx.seq_len + len(self.ctx.buffer())
        positions = list(range(first, first + len(tokens)))
        page = self.ctx.page_size
        if tokens and positions[0] // page != positions[-1] // page:
            self.page_crossings += 1
        self._last = len(tokens)
        return tokens, positions

    def accept(self, tokens: list[int]) -> None:
        self.produced += len(tokens)
        self.accepted_drafts += max(0, len(tokens) - 1)

    def rollback(self, n: int) -> None:
        self.rolled_back += n

    def reset(self) -> None:
        self.produced = 0


async def _drain(g) -> tuple[list[int], int]:
    tokens, steps = [], 0
    async for step in g:
        tokens += (await step.execute()).tokens
        steps += 1
    return tokens, steps


def _generation(spec: str, *, k: int = 4, max_tokens: int = 40, sampler=None, constrain=None, stop=(), cont=8):
    """An inferlet: prompt, generate with the given speculation, then ``cont`` more greedy tokens without it."""

    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.user(PROMPT)
            options = {"max_tokens": max_tokens, "constrain": constrain}
            oracle = None
            if spec == "system":
                options["system_speculation"] = True
            elif spec.startswith("oracle"):
                corrupt = input.get("corrupt")
                oracle = Oracle(ctx, input["truth"], k, *(corrupt or (None, None)))
                options["speculator"] = oracle
            g = ctx.generate(sampler or Sampler.argmax(), **options)
            g.add_stop(list(stop))
            tokens, steps = await _drain(g)
            state = (ctx.seq_len, ctx.buffer())
            after = await ctx.generate(Sampler.argmax(), max_tokens=cont, auto_flush=False).collect_tokens()
            return {
                "tokens": tokens,
                "steps": steps,
                "state": state,
                "after": after,
                "oracle": vars(oracle) if oracle else {},
            }

    return main


def test_system_speculation_gives_the_tokens_of_plain_greedy(served):
    plain = served.run(_generation("none", max_tokens=48))
    spec = served.run(_generation("system", max_tokens=48))
    assert spec["tokens"] == plain["tokens"] and len(plain["tokens"]) == 48
    assert spec["state"] == plain["state"] and spec["after"] == plain["after"]
    assert spec["steps"] <= plain["steps"]


def test_oracle_drafts_are_accepted_and_save_forward_passes(served):
    plain = served.run(_generation("none"))
    truth = plain["tokens"]
    spec = served.run(_generation("oracle", k=5), {"truth": truth})
    assert spec["tokens"] == truth
    assert spec["state"] == plain["state"] and spec["after"] == plain["after"]
    oracle = spec["oracle"]
    assert oracle["accepted_drafts"] > 0 and spec["steps"] < plain["steps"]
    assert spec["steps"] == -(-len(truth) // 6), "every true draft accepted: 5 drafts + 1 token per pass"
    assert oracle["page_crossings"] > 0, "some drafts straddle a page boundary"


def test_wrong_drafts_are_rejected_and_rolled_back(served):
    plain = served.run(_generation("none"))
    truth = plain["tokens"]
    wrong = [(t + 1) % 200 for t in truth]
    spec = served.run(_generation("oracle", k=3), {"truth": wrong})
    assert spec["tokens"] == truth and spec["after"] == plain["after"]
    assert spec["oracle"]["rolled_back"] > 0
    assert served.stats().working == 0, "rejected drafts' pages were given back"


def test_a_stop_token_inside_accepted_drafts_leaves_kv_and_buffer_consistent(served):
    truth = served.run(_generation("none"))["tokens"]
    stop = truth[17]
    cut = truth.index(stop)
    plain = served.run(_generation("none", stop=[stop]))
    assert plain["tokens"] == truth[:cut]
    spec = served.run(_generation("oracle", k=6, stop=[stop]), {"truth": truth})
    assert spec["tokens"] == truth[:cut]
    assert spec["state"] == plain["state"], "seq_len and buffer as if no draft past the stop was ever written"
    assert spec["after"] == plain["after"], "the KV holds nothing past the stop"


@pytest.mark.parametrize("max_tokens", [1, 7, 13])
def test_max_tokens_inside_drafts(served, max_tokens):
    truth = served.run(_generation("none"))["tokens"]
    plain = served.run(_generation("none", max_tokens=max_tokens))
    spec = served.run(_generation("oracle", k=6, max_tokens=max_tokens), {"truth": truth})
    assert spec["tokens"] == truth[:max_tokens] == plain["tokens"]
    assert spec["state"] == plain["state"] and spec["after"] == plain["after"]


def test_seeded_sampling_is_unchanged_by_speculation(served):
    """A seeded sampler draws from (seed, position), and verification is exact-match: drafts cannot bias it."""
    sampler = Sampler.multinomial(0.8, 1234)
    plain = served.run(_generation("none", sampler=sampler, max_tokens=32))
    spec = served.run(_generation("oracle", sampler=sampler, max_tokens=32), {"truth": plain["tokens"]})
    system = served.run(_generation("system", sampler=sampler, max_tokens=32))
    assert spec["tokens"] == plain["tokens"] == system["tokens"]


def test_speculation_under_a_grammar(served):
    constrain = Regex(DIGITS)
    plain = served.run(_generation("none", constrain=constrain))
    truth = plain["tokens"]
    spec = served.run(_generation("oracle", k=4, constrain=constrain), {"truth": truth})
    assert spec["tokens"] == truth and spec["after"] == plain["after"]
    assert spec["steps"] == -(-len(truth) // 5), "every draft is verified under the grammar's mask at its row"
    system = served.run(_generation("system", constrain=constrain))
    assert system["tokens"] == truth

    letter = _token_of(served, "x")
    forbidden = served.run(_generation("oracle", k=4, constrain=constrain), {"truth": truth, "corrupt": (2, letter)})
    assert forbidden["tokens"] == truth, "a draft the grammar forbids is never accepted"
    assert re.fullmatch(DIGITS, _decode(served, truth))


def test_speculator_errors_are_raised_in_the_inferlet(served):
    class Shifted(Oracle):
        def draft(self):
            tokens, positions = super().draft()
            return tokens, [p + 1 for p in positions]

    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user(PROMPT)
            g = ctx.generate(Sampler.argmax(), max_tokens=8, speculator=Shifted(ctx, [5, 6, 7], 3))
            return await g.collect_tokens()

    with pytest.raises(ValueError, match="drafts must continue the context in order"):
        served.run(main)

    async def both(input):
        with Context(Model.load("default")) as ctx:
            ctx.generate(Sampler.argmax(), speculator=Oracle(ctx, [], 1), system_speculation=True)

    with pytest.raises(ValueError, match="mutually exclusive"):
        served.run(both)

    async def not_a_speculator(input):
        with Context(Model.load("default")) as ctx:
            ctx.generate(Sampler.argmax(), speculator=object())

    with pytest.raises(TypeError, match="draft/accept/rollback/reset"):
        served.run(not_a_speculator)
    assert served.run(_generation("none", max_tokens=4))["tokens"], "the replica still serves"
    assert served.stats().working == 0


def test_ngram_drafter_copies_what_followed_the_latest_match():
    text = [1, 2, 3, 4, 5, 1, 2, 3]
    one, two, three = (SimpleNamespace(drafts=None) for _ in range(3))  # a context's record, as far as drafts go
    assert draft(one, lambda: text, len(text), 4, 5) == [5, 1, 2, 3, 4]
    assert draft(two, lambda: [7, 7, 7], 3, 7, 4) == [7, 7, 7, 7], "a repeat continues itself"
    assert draft(three, lambda: [1, 2], 2, 9, 4) == [], "nothing to copy"
    one.drafts.extend([4])
    assert draft(one, lambda: pytest.fail("rebuilt"), len(text) + 1, 5, 3) == [1, 2, 3], "kept incrementally"
    assert draft(one, lambda: [9, 8, 9], 3, 8, 2) == [9, 8], "a length mismatch rebuilds the index"


def _token_of(served, text: str) -> int:
    async def main(input):
        return Model.load("default").tokenizer().encode(input["text"])

    ids = served.run(main, {"text": text})
    assert len(ids) == 1
    return ids[0]


def _decode(served, tokens: list[int]) -> str:
    async def main(input):
        return Model.load("default").tokenizer().decode(input["tokens"])

    return served.run(main, {"tokens": tokens})
