"""Grammars (JSON Schema, regex, EBNF) and the ``Matcher`` that walks one token by token, built on xgrammar.

Why xgrammar: Pie's own grammar engine is a port of it (a pushdown automaton with per-state token masks computed
ahead of time), so masks cost tens of microseconds per token. xgrammar imports torch, so it is imported only when
a grammar is built; ``import inferlet`` stays light.

A ``Grammar`` is parsed when constructed (bad input fails there, with the compiler's message) and compiled for a
tokenizer when a ``Matcher`` first needs it; compiled grammars are cached per (grammar, tokenizer) in a bounded LRU
shared by every inferlet in the process. Masks are BRLE over the tokenizer's ids; ids past the tokenizer's vocabulary
(a model may pad its logits) read as false, so they are never allowed.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from pie_workers.wire import brle

from inferlet.tokenizer import Tokenizer

if TYPE_CHECKING:
    from inferlet.instruct import ModelLike

COMPILED_CACHE_SIZE = 256  # compiled grammars kept per process (each holds token masks for its grammar states)
MASK_CACHE_BYTES = 1 << 20  # per Matcher: the packed bitmasks kept (as keys) with the BRLE each encodes to

# JSON text never holds raw control bytes (0x00-0x1f) except whitespace between values. xgrammar 0.2.8 lets strings
# with minLength/maxLength contain them (invalid JSON), so JSON grammars also forbid tokens that carry other ones.
_JSON_WHITESPACE = b"\t\n\r"
# A GBNF rule definition (`name ::= ...`); Lark writes `name: ...`.
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)
# xgrammar prefixes errors with a log header ("[12:00:00] /path/file.cc:123: ") and sometimes an assertion text.
_LOG_HEADER = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgrammar():
    import xgrammar

    return xgrammar


def _compiler_error(what: str, error: Exception) -> ValueError:
    return ValueError(f"invalid {what}: {_LOG_HEADER.sub('', str(error).strip())}")


class Grammar:
    """A parsed grammar, not yet bound to a tokenizer. Use the ``from_*`` constructors.

    Also a ``Schema``: pass it to ``ctx.generate(constrain=...)`` directly.
    """

    def __init__(self, key: tuple, native: Any, json_controls: bytes | None = None) -> None:
        """``key`` identifies the source for the compile cache; ``json_controls`` is set for JSON grammars: the
        control bytes their text may contain (whitespace, when any is allowed)."""
        self._key = key
        self._native = native
        self._json_controls = json_controls

    @staticmethod
    def from_json_schema(schema: str | dict, *, any_whitespace: bool = False) -> Grammar:
        """JSON conforming to a JSON Schema (text or dict).

        Compact by default (``{"a": 1, "b": [2, 3]}``, the separators of ``json.dumps``): models left free to add
        whitespace tend to emit it forever. ``any_whitespace=True`` allows any whitespace between values.
        """
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            native = _xgrammar().Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        except RuntimeError as e:
            raise _compiler_error("JSON schema", e) from None
        controls = _JSON_WHITESPACE if any_whitespace else b""
        return Grammar(("json_schema", text, any_whitespace), native, controls)

    @staticmethod
    def json(*, any_whitespace: bool = False) -> Grammar:
        """Any JSON value (the empty schema), compact unless ``any_whitespace``."""
        return Grammar.from_json_schema("{}", any_whitespace=any_whitespace)

    @staticmethod
    def from_regex(pattern: str) -> Grammar:
        """Text matching the whole regular expression."""
        try:
            native = _xgrammar().Grammar.from_regex(pattern)
        except RuntimeError as e:
            raise _compiler_error("regex", e) from None
        return Grammar(("regex", pattern), native)

    @staticmethod
    def from_ebnf(source: str) -> Grammar:
        """An EBNF grammar in Lark syntax (start rule ``start``), as the SDK reference specifies, or in GBNF syntax
        (``root ::= ...``, what Pie's engine and xgrammar natively parse); rules written with ``::=`` mean GBNF."""
        xgr = _xgrammar()
        gbnf = bool(_GBNF_RULE.search(source))
        try:
            native = xgr.Grammar.from_ebnf(source) if gbnf else xgr.Grammar.from_lark(source)
        except RuntimeError as e:
            raise _compiler_error("GBNF grammar" if gbnf else "Lark grammar", e) from None
        return Grammar(("ebnf", source), native)

    @staticmethod
    def _tagged_json(schema: dict, begin: str, end: str, separator: str) -> Grammar:
        """One or more compact JSON documents matching ``schema``, each between ``begin`` and ``end``, separated by
        ``separator`` (tool calls in Qwen-style syntax).

        The JSON part is xgrammar's own conversion of the schema, printed as GBNF (its root rule is ``root``) and
        referenced from the wrapping rules.
        """
        document = Grammar.from_json_schema(schema)
        lit = lambda text: json.dumps(text, ensure_ascii=False)  # a GBNF string literal uses JSON's escapes
        source = f"tagged ::= tag ({lit(separator)} tag)*\ntag ::= {lit(begin)} root {lit(end)}\n{document}"
        try:
            native = _xgrammar().Grammar.from_ebnf(source, root_rule_name="tagged")
        except RuntimeError as e:
            raise _compiler_error("tagged JSON grammar", e) from None
        controls = bytes(sorted(set((begin + end + separator).encode()) & set(range(32))))
        return Grammar(("tagged_json", source), native, controls)

    def build_constraint(self, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.from_grammar(self, model)

    def __str__(self) -> str:
        """The grammar in GBNF, as the compiler normalised it."""
        return str(self._native)

    def __repr__(self) -> str:
        return f"Grammar({self._key[0]}: {self._key[1][:60]!r})"


class Matcher:
    """Walks a grammar token by token: which tokens may come next, and whether the grammar has ended.

    ``stop_tokens`` are the ids that end the text once the grammar is complete (default: the tokenizer's EOS); they
    are allowed only then, and accepting one terminates the matcher.
    """

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, *, stop_tokens: Iterable[int] | None = None) -> None:
        if stop_tokens is None:
            stop_tokens = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        stops = [int(t) for t in stop_tokens]
        self._tokenizer = tokenizer
        self._vocab = _tokenizer_info(tokenizer).vocab_size
        # xgrammar refuses an empty override; without stop tokens the grammar simply never terminates.
        self._matcher = _xgrammar().GrammarMatcher(_compiled(grammar, tokenizer), override_stop_tokens=stops or None)
        self._words = np.zeros((self._vocab + 31) // 32, dtype=np.int32)
        controls = grammar._json_controls
        self._allowed = None if controls is None else _tokens_without_controls(tokenizer, controls, tuple(stops))
        # Grammar states recur (every item of a JSON array, every character of a string), and so do their masks:
        # encoding one again costs a dozen numpy calls, looking it up one bytes copy.
        self._encoded: dict[bytes, tuple[int, ...]] = {}
        self._encoded_max = max(1, MASK_CACHE_BYTES // self._words.nbytes)

    def accept_tokens(self, ids: Iterable[int]) -> None:
        """Advance past ``ids``. All or nothing: if one is not allowed, none is taken and ``ValueError`` says which."""
        for taken, t in enumerate(int(t) for t in ids):
            if not (0 <= t < self._vocab and self._matcher.accept_token(t)):
                if taken:
                    self._matcher.rollback(taken)
                text = self._tokenizer.decode([t]) if 0 <= t < self._vocab else "<out of vocabulary>"
                raise ValueError(f"token {t} ({text!r}) is not allowed by the grammar here (after {taken} of these)")

    def next_token_logit_mask(self) -> list[int]:
        """BRLE over the vocabulary of the tokens allowed next; all false once the matcher has terminated."""
        if self._matcher.is_terminated():
            return [self._vocab]
        self._matcher.fill_next_token_bitmask(self._words)
        raw = self._words.tobytes()
        runs = self._encoded.get(raw)
        if runs is None:
            if self._allowed is not None:
                np.bitwise_and(self._words, self._allowed, out=self._words)
            runs = tuple(brle.from_bitmask(self._words, self._vocab))
            if len(self._encoded) >= self._encoded_max:
                del self._encoded[next(iter(self._encoded))]  # the oldest
            self._encoded[raw] = runs
        return list(runs)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculation verifies drafts ahead of the accepted text)."""
        self._matcher.rollback(n)

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted with the grammar complete."""
        return self._matcher.is_terminated()

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._matcher.reset()


class GrammarConstraint:
    """A ``Constraint`` that walks a grammar with a ``Matcher``.

    The constructors bind the grammar to the model's tokenizer with the chat template's end-of-turn tokens as the
    grammar's stop tokens: they are allowed exactly when the grammar is complete, so with the Generator's default
    stop set the model ends its turn right where the grammar does.
    """

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher

    @staticmethod
    def from_grammar(grammar: Grammar, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint(Matcher(grammar, model.tokenizer(), stop_tokens=model.instruct.stop_tokens()))

    @staticmethod
    def from_json_schema(schema: str | dict, model: ModelLike, *, any_whitespace: bool = False) -> GrammarConstraint:
        return GrammarConstraint.from_grammar(Grammar.from_json_schema(schema, any_whitespace=any_whitespace), model)

    @staticmethod
    def json(model: ModelLike, *, any_whitespace: bool = False) -> GrammarConstraint:
        return GrammarConstraint.from_grammar(Grammar.json(any_whitespace=any_whitespace), model)

    @staticmethod
    def from_regex(pattern: str, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.from_grammar(Grammar.from_regex(pattern), model)

    @staticmethod
    def from_ebnf(source: str, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.from_grammar(Grammar.from_ebnf(source), model)

    def step(self, accepted: list[int]) -> list[int]:
        if accepted:
            self.matcher.accept_tokens(accepted)
        return self.matcher.next_token_logit_mask()

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated


@functools.cache
def _tokenizer_info(tokenizer: Tokenizer):
    """The tokenizer as xgrammar sees it: raw bytes per id, with special tokens blanked.

    Blank entries are what xgrammar treats as special: never matched as text, so a grammar cannot spell
    ``<|im_end|>`` inside a JSON string; a Matcher allows its stop tokens explicitly instead.
    """
    xgr = _xgrammar()
    ids, pieces = tokenizer.vocabs()
    size = max(tokenizer.vocab_size, ids[-1] + 1 if ids else 0)
    vocab = [b""] * size
    for i, piece in zip(ids, pieces, strict=True):
        if i not in tokenizer.special_ids:
            vocab[i] = piece
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=size, stop_token_ids=[])


@functools.cache
def _compiler(tokenizer: Tokenizer):
    # One compiler per tokenizer; this module's LRU is the only cache (xgrammar's own would hold a second copy).
    return _xgrammar().GrammarCompiler(_tokenizer_info(tokenizer), max_threads=1, cache_enabled=False)


_compiled_lru: OrderedDict[tuple, Any] = OrderedDict()


def _compiled(grammar: Grammar, tokenizer: Tokenizer):
    """The grammar compiled for this tokenizer, from the per-process LRU."""
    key = (grammar._key, tokenizer)
    hit = _compiled_lru.get(key)
    if hit is not None:
        _compiled_lru.move_to_end(key)
        return hit
    try:
        compiled = _compiler(tokenizer).compile_grammar(grammar._native)
    except RuntimeError as e:
        raise _compiler_error(f"{grammar._key[0]} grammar", e) from None
    _compiled_lru[key] = compiled
    if len(_compiled_lru) > COMPILED_CACHE_SIZE:
        _compiled_lru.popitem(last=False)
    return compiled


@functools.cache
def _tokens_without_controls(tokenizer: Tokenizer, allowed: bytes, stops: tuple[int, ...]) -> np.ndarray:
    """Packed bitmask of the tokens whose bytes hold no control byte except ``allowed`` (stop tokens always pass)."""
    ids, pieces = tokenizer.vocabs()
    size = _tokenizer_info(tokenizer).vocab_size
    forbidden = bytes(b for b in range(32) if b not in allowed)
    ok = np.ones(((size + 31) // 32) * 32, dtype=bool)
    for i, piece in zip(ids, pieces, strict=True):
        if piece.translate(None, forbidden) != piece:
            ok[i] = False
    ok[list(stops)] = True
    return np.packbits(ok, bitorder="little").view("<i4").astype(np.int32)
