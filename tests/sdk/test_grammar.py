"""Grammar and Matcher on xgrammar without a replica (the tiny model's tokenizer only): walking, accepting and
terminating, masks on recurring states, rejected tokens, special tokens, the families' native tool-call syntax,
caching, schemas, and an SDK import that does not load xgrammar; then the BRLE mask encoding the constraint path
relies on. Constrained generation on a replica is in ``test_constraints.py``.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from grammars import CLOCK, GREETING_LARK, PERSON, STOPS, WEATHER
from hypothesis import given
from hypothesis import strategies as st
from inferlet import AnyJson, Ebnf, Grammar, GrammarConstraint, JsonSchema, Matcher, Regex, tools
from inferlet.grammar import _compiled
from inferlet.instruct import LLAMA3_TOOL_CALLS
from inferlet.tokenizer import Tokenizer
from pie_workers.wire import brle

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


# --- BRLE, the logit-mask encoding the constraint path relies on ------------------------------------------------------


@given(st.lists(st.booleans(), max_size=200))
def test_from_bitmask_and_allows_agree_with_the_bits(bits):
    words = np.packbits(np.array(bits + [False] * (-len(bits) % 32), dtype=bool), bitorder="little").view("<i4")
    runs = brle.from_bitmask(words, len(bits))
    assert runs == brle.encode(bits)
    assert [brle.allows(runs, i) for i in range(len(bits) + 3)] == bits + [False] * 3


@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=50))
def test_packed_masks_read_back_as_their_runs(runs):
    assert brle.unpack(brle.pack(runs)).tolist() == runs


@pytest.mark.parametrize("bad", [[-1], [2.5], [1 << 32], ["a"]])
def test_packing_refuses_what_is_not_run_lengths(bad):
    with pytest.raises(brle.BrleError, match="malformed logit mask"):
        brle.pack(bad, "logit mask")
