"""Grammar-constrained generation end to end: constraints composed in the Generator on a served replica (every test
on the torch and the vllm backend), then bad grammars and constraints that cannot be met.

Outputs are sampled from the random tiny model at temperature 1 (close to a random walk over whatever the mask
allows), so every seed stresses the grammar; JSON is validated with the `jsonschema` package, regexes with `re`.
Grammar and Matcher without a replica are in ``test_grammar.py``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from grammars import ANSWER, CLOCK, GREETING, GREETING_GBNF, GREETING_LARK, PERSON, SEEDS, STOPS, WEATHER
from inferlet import (
    Context,
    Ebnf,
    GrammarConstraint,
    JsonSchema,
    Logits,
    Model,
    Regex,
    Sampler,
    tools,
)
from inferlet.tokenizer import Tokenizer
from pie_cluster.hosts.run import load_program
from pie_workers.wire import brle
from support.paths import EXAMPLES
from support.sdk_host import each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend


def sampled(input: dict) -> Sampler:
    return Sampler.multinomial(1.0, input["seed"])


def run_seeds(served, main, extra: dict | None = None, seeds=SEEDS) -> list:
    """One inferlet per seed, all at once (their steps share batches); re-raises the first failure."""
    results = served.run_many([(main, {"seed": s, **(extra or {})}) for s in seeds])
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# --- end to end: every sampled output obeys its constraint -------------------------------------------------------


def test_collect_json_with_a_schema_always_validates(served):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.system("Reply with a JSON person.").user(f"Person number {input['seed']}?")
            g = ctx.generate(sampled(input), max_tokens=160)
            return await g.collect_json(schema=PERSON), g.tokens_generated

    results = run_seeds(served, main)
    for value, n in results:
        jsonschema.validate(value, PERSON)
        assert n < 160, "the grammar, not max_tokens, ended generation"
    assert len({json.dumps(v) for v, _ in results}) > len(results) // 2, "seeds sample different documents"


def test_collect_json_without_a_schema_yields_any_json_value(served):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("Anything in JSON.")
            g = ctx.generate(sampled(input), max_tokens=48)
            try:
                return "parsed", await g.collect_json()
            except ValueError:
                return "cut", g.tokens_generated

    results = run_seeds(served, main)
    assert any(kind == "parsed" for kind, _ in results), "some random documents end within 48 tokens"
    assert all(n == 48 for kind, n in results if kind == "cut"), "only max_tokens leaves JSON unfinished"


def test_regex_constraint_always_matches(served):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("Answer.")
            g = ctx.generate(sampled(input), max_tokens=32, constrain=Regex(ANSWER))
            return await g.collect_text()

    for text in run_seeds(served, main):
        assert re.fullmatch(ANSWER, text), text


@pytest.mark.parametrize("source", [GREETING_LARK, GREETING_GBNF], ids=["lark", "gbnf"])
def test_ebnf_constraint_always_matches(served, source):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("Greet.")
            return await ctx.generate(sampled(input), max_tokens=32, constrain=[Ebnf(input["source"])]).collect_text()

    for text in run_seeds(served, main, {"source": source}):
        assert GREETING.fullmatch(text), text


class NoSevens:
    """A custom Constraint: forbids every token whose text contains a 7, and records what it was told."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.mask = brle.encode([b"7" not in p for p in tokenizer.vocabs()[1]])
        self.calls: list[list[int]] = []

    def step(self, accepted: list[int]) -> list[int]:
        self.calls.append(list(accepted))
        return self.mask


def test_custom_constraint_ands_with_a_schema_and_logit_mask(served):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 3, "maxItems": 6}

    async def main(input):
        model = Model.load("default")
        tk = model.tokenizer()
        custom = NoSevens(tk)
        no_eights = brle.encode([b"8" not in p for p in tk.vocabs()[1]])
        with Context(model) as ctx:
            ctx.user("Numbers.")
            g = ctx.generate(sampled(input), max_tokens=48, constrain=custom, logit_mask=no_eights)
            g.constrain(JsonSchema(schema))
            tokens = await g.collect_tokens()
            return tk.decode(tokens), tokens, custom.calls

    for text, tokens, calls in run_seeds(served, main):
        jsonschema.validate(json.loads(text), schema)
        assert "7" not in text and "8" not in text, text
        assert calls[0] == [] and [t for c in calls[1:] for t in c] == tokens, "stepped once per token, in order"


def test_grammar_ends_generation_even_without_its_stop_token_in_the_stop_set(served):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("Digits.").cue()
            g = ctx.generate(sampled(input), max_tokens=32, auto_flush=False, constrain=Regex("[0-9]{2}"))
            tokens = await g.collect_tokens()
            return tokens, g.is_done, Model.load("default").tokenizer().decode(tokens[:-1])

    for tokens, done, text in run_seeds(served, main):
        assert done and tokens[-1] in STOPS, "the grammar's stop token ended it and, not being a stop here, is kept"
        assert re.fullmatch("[0-9]{2}", text)


def test_manual_accept_is_reconciled_with_the_constraints(served):
    async def main(input):
        model = Model.load("default")
        tk = model.tokenizer()
        with Context(model) as ctx:
            ctx.user("Yes or no?")
            g = ctx.generate(Sampler.argmax(), max_tokens=8, constrain=Regex("(yes|no)"))
            z = tk.encode("z")[0]  # never allowed by the regex
            kept, refused = [], []
            async for step in g:
                step.clear_sampler()
                h = step.probe(0, Logits())
                logits = np.frombuffer((await step.execute()).logits(h), dtype=np.float32)
                refused.append((logits[z], g.accept([z])))  # the probe sees the mask; accept cuts the token
                kept += g.accept([int(np.argmax(logits)), z])  # allowed, then cut at the forbidden one
            return tk.decode(kept), refused, g.is_done

    text, refused, done = served.run(main, {})
    assert text in ("yes", "no") and done
    assert all(logit == -np.inf and accepted == [] for logit, accepted in refused)


def test_native_tool_calls_parse_and_match_their_schema(served):
    async def main(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.append(tools.equip_prefix(model, [WEATHER, CLOCK])).user("Weather in Oslo?")
            matcher = tools.native_matcher(model, [WEATHER, CLOCK])
            g = ctx.generate(sampled(input), max_tokens=160, constrain=GrammarConstraint(matcher))
            decoder = tools.Decoder(model)
            calls = []
            async for step in g:
                event = decoder.feed((await step.execute()).tokens)
                while isinstance(event, tools.Call):
                    calls.append(event)
                    event = decoder.feed([])
            return [(c.name, json.loads(c.args)) for c in calls]

    for calls in run_seeds(served, main, seeds=range(1, 9)):  # long prompts: fewer seeds
        assert calls, "at least one complete call (the grammar allows more, separated by newlines)"
        for name, args in calls:
            schema = WEATHER["function"]["parameters"] if name == "get_weather" else CLOCK["parameters"]
            assert name in ("get_weather", "get_time")
            jsonschema.validate(args, schema)


def test_json_extraction_example_validates(served):
    example = load_program(EXAMPLES / "json_extraction.py")
    person = example.__globals__["PERSON"]
    custom = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    inputs = [{"temperature": 1.0, "seed": s} for s in range(1, 5)] + [{}, {"schema": json.dumps(custom)}]
    results = served.run_many([(example, i) for i in inputs])
    for value in results[:-1]:
        jsonschema.validate(value, person)
    jsonschema.validate(results[-1], custom)


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (JsonSchema('{"type": "nonsense"}'), 'invalid JSON schema: Unsupported type "nonsense"'),
        (JsonSchema("{not json"), "invalid JSON schema: Failed to parse JSON"),
        (Regex("a(b"), "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
        (Ebnf('root ::= "a" | foo'), 'invalid GBNF grammar: EBNF parser error at line 1, column 16: Rule "foo"'),
    ],
)
def test_invalid_grammar_raises_at_constrain_time_with_the_compilers_message(served, constraint, message):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            g = ctx.generate(Sampler.argmax(), max_tokens=4)
            try:
                g.constrain(constraint)
            except ValueError as e:
                sent = ctx.seq_len
                return str(e), sent, await ctx.generate(Sampler.argmax(), max_tokens=2).collect_tokens()
            return None

    error, sent, after = served.run(main, {})
    assert error is not None and error.startswith(message), error
    assert sent == 0 and len(after) == 2, "nothing was sent; the context still generates"


def test_constraints_that_allow_nothing_together_fail_before_the_step(served):
    async def main(input):
        model = Model.load("default")
        a = model.tokenizer().encode("a")[0]
        only_a = [a, 1]
        with Context(model) as ctx:
            ctx.user("b?")
            g = ctx.generate(Sampler.argmax(), max_tokens=4, logit_mask=only_a, constrain=Regex("b"))
            try:
                await g.collect_tokens()
            except ValueError as e:
                return str(e), len(ctx.buffer()), ctx.seq_len
            return None

    error, buffered, seq_len = served.run(main, {})
    assert error == "the attached constraints allow no token at this step (their masks AND to nothing)"
    assert buffered > 0 and seq_len == 0, "nothing was sent"


def test_collect_json_reports_output_cut_short_by_max_tokens(served):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("JSON.")
            return await ctx.generate(sampled(input), max_tokens=3).collect_json(schema=PERSON)

    with pytest.raises(ValueError, match=r"not complete JSON .* after 3 tokens \(max_tokens=3\)"):
        served.run(main, {"seed": 1})


def test_collect_json_parse_callback_gets_the_text(served):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("JSON.")
            g = ctx.generate(sampled(input), max_tokens=64)
            return await g.collect_json(schema={"enum": ["on", "off"]}, parse=lambda text: ("parsed", text))

    assert served.run(main, {"seed": 3}) in (("parsed", '"on"'), ("parsed", '"off"'))
