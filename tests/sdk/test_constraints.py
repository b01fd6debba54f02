"""Grammar-constrained generation: Grammar/Matcher on xgrammar, constraints composed in the Generator, end to end.

Outputs are sampled from the random tiny model at temperature 1 (close to a random walk over whatever the mask
allows), so every seed stresses the grammar; JSON is validated with the `jsonschema` package, regexes with `re`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from inferlet import (
    AnyJson,
    Context,
    Ebnf,
    Grammar,
    GrammarConstraint,
    JsonSchema,
    Logits,
    Matcher,
    Model,
    Regex,
    Sampler,
    tools,
)
from inferlet.grammar import _compiled
from inferlet.instruct import LLAMA3_TOOL_CALLS
from inferlet.tokenizer import Tokenizer
from pie_cluster.host import load_program
from pie_workers.wire import brle
from sdk_host import each_backend
from test_sdk_chat import StubModel

served = each_backend()  # every test here runs on the torch and the vllm backend

STOPS = [2, 0]  # <|im_end|>, <|endoftext|>: the ChatML template's end-of-turn set
SEEDS = range(1, 13)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "score": {"enum": [1, 2.5, None]}},
            "required": ["zip", "score"],
        },
    },
    "required": ["name", "age", "tags", "ok", "home"],
}
ANSWER = r"(yes|no): [0-9]{1,3}(\.[0-9])?"
GREETING_LARK = 'start: GREETING " " NAME "!"\nGREETING: "hello" | "hi"\nNAME: /[a-z]{1,6}/\n'
GREETING_GBNF = 'root ::= ("hello" | "hi") " " [a-z]{1,6} "!"'
GREETING = re.compile(r"(hello|hi) [a-z]{1,6}!")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "required": []}}


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> StubModel:
    """The tiny model's tokenizer and chat template without a replica: what grammars and matchers need."""
    return StubModel(tiny_llama)


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


@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=50))
def test_packed_masks_read_back_as_their_runs(runs):
    assert brle.unpack(brle.pack(runs)).tolist() == runs


@pytest.mark.parametrize("bad", [[-1], [2.5], [1 << 32], ["a"]])
def test_packing_refuses_what_is_not_run_lengths(bad):
    with pytest.raises(brle.BrleError, match="malformed logit mask"):
        brle.pack(bad, "logit mask")


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
    example = load_program(Path(__file__).resolve().parents[2] / "examples" / "json_extraction.py")
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


# --- Grammar and Matcher without a replica -----------------------------------------------------------------------


def test_matcher_walks_accepts_terminates_and_resets(tiny):
    tk = tiny.tokenizer()
    m = Matcher(Grammar.from_json_schema(PERSON), tk, stop_tokens=STOPS)
    doc = '{"name": "bob", "age": 42, "tags": ["red"], "ok": true, "home": {"zip": "01234", "score": 2.5}}'
    for t in tk.encode(doc):
        assert brle.allows(m.next_token_logit_mask(), t)
        assert not any(brle.allows(m.next_token_logit_mask(), s) for s in STOPS), "no stop before the end"
        m.accept_tokens([t])
    end = m.next_token_logit_mask()
    assert np.flatnonzero(brle.decode(end)).tolist() == sorted(STOPS), "only the stop tokens once complete"
    assert brle.length(end) == tk.vocab_size and not m.is_terminated
    m.accept_tokens([2])
    assert m.is_terminated and m.next_token_logit_mask() == [tk.vocab_size]
    m.reset()
    first = np.flatnonzero(brle.decode(m.next_token_logit_mask()))
    assert not m.is_terminated and tk.encode("{")[0] in first and all(tk.decode([t])[0] == "{" for t in first)


def test_a_matcher_gives_the_same_masks_when_its_states_recur(tiny):
    """Masks are kept per raw bitmask: a state seen before (the next item of an array) must give what a fresh
    matcher computes there, the JSON control-byte filter included."""
    tk = tiny.tokenizer()
    grammar = Grammar.from_json_schema({"type": "array", "items": {"enum": ["red", "green"]}})
    doc = tk.encode('["red", "green", "red", "red", "green"]')
    walked = Matcher(grammar, tk, stop_tokens=STOPS)
    for n, t in enumerate(doc):
        fresh = Matcher(grammar, tk, stop_tokens=STOPS)
        fresh.accept_tokens(doc[:n])
        assert walked.next_token_logit_mask() == fresh.next_token_logit_mask()
        walked.accept_tokens([t])
    assert len(walked._encoded) < len(doc), "states recurred"


def test_rejected_tokens_leave_the_matcher_untouched(tiny):
    tk = tiny.tokenizer()
    m = Matcher(Grammar.from_regex("ab+c"), tk)
    before = m.next_token_logit_mask()
    with pytest.raises(ValueError, match=r"token \d+ \('c'\) is not allowed by the grammar here \(after 3 of these\)"):
        m.accept_tokens(tk.encode("a") + tk.encode("b") + tk.encode("c") + tk.encode("c"))
    with pytest.raises(ValueError, match="out of vocabulary"):
        m.accept_tokens([99999])
    assert m.next_token_logit_mask() == before
    assert Matcher(Grammar.from_regex("a"), tk).next_token_logit_mask() != []


def test_special_tokens_never_match_as_text_and_json_forbids_control_bytes(tiny):
    tk = tiny.tokenizer()
    ids, pieces = tk.vocabs()
    m = Matcher(Grammar.from_json_schema({"type": "string", "maxLength": 8}), tk, stop_tokens=STOPS)
    m.accept_tokens(tk.encode('"'))
    allowed = brle.decode(m.next_token_logit_mask(), tk.vocab_size)
    assert not allowed[[1, 2, 0]].any(), "<|im_start|> etc. are not string content"
    assert not any(allowed[i] and any(b < 0x20 for b in p) for i, p in zip(ids, pieces, strict=True))
    assert allowed[tk.encode("a")[0]]


def test_native_matcher_follows_the_family_syntax(tiny):
    tk = tiny.tokenizer()
    qwen = tools.native_matcher(tiny, [WEATHER, CLOCK])
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    qwen.accept_tokens(tk.encode(f"<tool_call>\n{call}\n</tool_call>\n<tool_call>\n"))
    qwen.accept_tokens(tk.encode('{"name": "get_time", "arguments": {}}\n</tool_call>'))
    assert np.flatnonzero(brle.decode(qwen.next_token_logit_mask())).tolist()[:2] == [0, 2], "may end the turn"
    llama3 = SimpleNamespace(tokenizer=tiny.tokenizer, instruct=SimpleNamespace(tool_call_format=LLAMA3_TOOL_CALLS))
    llama3.instruct.stop_tokens = lambda: STOPS
    bare = tools.native_matcher(llama3, [WEATHER])
    with pytest.raises(ValueError, match="not allowed"):
        bare.accept_tokens(tk.encode("<tool_call>"))
    bare.accept_tokens(tk.encode('{"name": "get_weather", "parameters": {"city": "Paris", "days": 7}}'))
    with pytest.raises(ValueError, match="not allowed"):
        bare.accept_tokens(tk.encode("\n"))  # one bare call, then only the end of the turn
    with pytest.raises(ValueError, match="no string 'name'"):
        tools.native_matcher(tiny, [{"parameters": {}}])


def test_compiled_grammars_are_cached_per_source_and_tokenizer(tiny, tiny_qwen3):
    tk = tiny.tokenizer()
    assert _compiled(Grammar.from_regex("[ab]+"), tk) is _compiled(Grammar.from_regex("[ab]+"), tk)
    assert _compiled(Grammar.from_regex("[ab]+"), tk) is not _compiled(Grammar.from_regex("[ab]*"), tk)
    other = Tokenizer.from_dir(tiny_qwen3)
    assert _compiled(Grammar.from_regex("[ab]+"), other) is not _compiled(Grammar.from_regex("[ab]+"), tk)


def test_schemas_build_grammar_constraints(tiny):
    for schema in (AnyJson(), JsonSchema(PERSON), Regex("x+"), Ebnf(GREETING_LARK), Grammar.json()):
        c = schema.build_constraint(tiny)
        assert isinstance(c, GrammarConstraint) and c.step([]) and not c.is_terminated
    assert "root ::=" in str(Grammar.from_regex("x+"))


def test_sdk_import_does_not_import_xgrammar():
    code = "import sys, inferlet; heavy = {'torch', 'xgrammar'} & set(sys.modules); assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- BRLE helpers the constraint path relies on -------------------------------------------------------------------


@given(st.lists(st.booleans(), max_size=200))
def test_from_bitmask_and_allows_agree_with_the_bits(bits):
    words = np.packbits(np.array(bits + [False] * (-len(bits) % 32), dtype=bool), bitorder="little").view("<i4")
    runs = brle.from_bitmask(words, len(bits))
    assert runs == brle.encode(bits)
    assert [brle.allows(runs, i) for i in range(len(bits) + 3)] == bits + [False] * 3
