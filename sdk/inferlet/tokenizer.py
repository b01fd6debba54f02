"""The model's tokenizer, run inside the inferlet process.

Why in-process: chat templates, decoders and grammar masks touch the tokenizer on every generated token, so a
round trip to the host per call would dominate decoding. Only the Rust `tokenizers` library is used (no torch or
transformers), which keeps the SDK import light.

Semantics follow Pie's host tokenizer: `encode` splits added/special tokens that appear literally in the text into
their ids and adds no BOS or post-processor tokens; `decode` keeps special tokens.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import tokenizers

# GPT-2's pre-tokenizer pattern: what a ByteLevel pre-tokenizer with `use_regex` splits on.
GPT2_SPLIT_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: the character a vocab entry uses -> the raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 256
    for b in range(256):
        if b not in printable:
            table[chr(shifted)] = b
            shifted += 1
    return table


def _walk(component: Any) -> Iterator[dict]:
    """Every component dict in a (possibly nested `Sequence`) pre-tokenizer or decoder state."""
    if isinstance(component, dict):
        yield component
        for value in component.values():
            yield from _walk(value)
    elif isinstance(component, list):
        for value in component:
            yield from _walk(value)


def _state(component: Any) -> list[dict]:
    """The JSON description of a tokenizers component (pre-tokenizer, decoder), flattened; [] when absent."""
    return [] if component is None else list(_walk(json.loads(component.__getstate__())))


def _content(entry: Any) -> str | None:
    """A token named in tokenizer_config.json, written either as a string or as an AddedToken dict."""
    return entry.get("content") if isinstance(entry, dict) else entry


class Tokenizer:
    """Text <-> token ids for one model, plus the vocabulary views that grammar engines need."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict | None = None) -> None:
        """`backend` is the model's tokenizer.json; `config` its tokenizer_config.json (named and extra specials)."""
        self._tk = backend
        config = config or {}
        added = backend.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        special = {i for i, t in added.items() if t.special}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if entry.get("special"):
                special.add(int(key))
        named = {name: _content(config.get(name)) for name in _NAMED_SPECIALS}
        self._named = {name: backend.token_to_id(tok) if tok else None for name, tok in named.items()}
        special.update(i for i in self._named.values() if i is not None)
        self.special_ids: frozenset[int] = frozenset(special)
        self._pre = _state(backend.pre_tokenizer)
        self._byte_level = any(c.get("type") == "ByteLevel" for c in self._pre + _state(backend.decoder))

    @staticmethod
    def from_dir(path: str | Path) -> Tokenizer:
        """The tokenizer of a HF model directory; one instance per directory per process (it is immutable)."""
        return _load(str(Path(path).resolve()))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (the model's logit width may be larger, e.g. padded)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The `eos_token` of tokenizer_config.json, if it names a token in the vocabulary."""
        return self._named["eos_token"]

    @property
    def bos_token_id(self) -> int | None:
        """The `bos_token` of tokenizer_config.json, if it names a token in the vocabulary."""
        return self._named["bos_token"]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; literal special tokens become their ids, and no BOS/post-processor ids are added."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: Iterable[int]) -> str:
        """Text of `tokens`, special tokens included; incomplete UTF-8 at the edges decodes to U+FFFD."""
        return self._tk.decode(list(tokens), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (in its vocabulary spelling, e.g. `<|im_end|>`), or None."""
        return self._tk.token_to_id(token)

    def vocabs(self) -> tuple[list[int], list[bytes]]:
        """Every token id with the raw bytes it stands for, sorted by id (fresh lists: callers may mutate them)."""
        ids, pieces = self._vocab
        return list(ids), list(pieces)

    def special_tokens(self) -> tuple[list[int], list[bytes]]:
        """Ids of the special tokens (BOS, EOS, role markers, ...) with their literal text as bytes."""
        ids = sorted(self.special_ids)
        return ids, [self._added.get(i, self._tk.id_to_token(i) or "").encode() for i in ids]

    def split_regex(self) -> str:
        """The pre-tokenizer's split pattern ("" if it has none, e.g. SentencePiece-style Metaspace)."""
        for component in self._pre:
            if component.get("type") == "Split":
                pattern = component["pattern"]
                return pattern["Regex"] if "Regex" in pattern else re.escape(pattern["String"])
        if any(c.get("type") == "ByteLevel" and c.get("use_regex", True) for c in self._pre):
            return GPT2_SPLIT_REGEX
        return ""

    @functools.cached_property
    def _vocab(self) -> tuple[list[int], list[bytes]]:
        """Built on first use: a 150k-entry vocabulary takes ~0.1 s."""
        to_bytes = self._piece_bytes()
        pairs = sorted((i, piece) for piece, i in self._tk.get_vocab(with_added_tokens=True).items())
        ids = [i for i, _ in pairs]
        pieces = [self._added[i].encode() if i in self._added else to_bytes(piece) for i, piece in pairs]
        return ids, pieces

    def _piece_bytes(self) -> Callable[[str], bytes]:
        """How a model-vocabulary spelling maps to raw bytes: byte-level alphabet, or SentencePiece conventions."""
        if self._byte_level:
            alphabet = _byte_level_alphabet()

            def byte_level(piece: str) -> bytes:
                try:
                    return bytes(alphabet[c] for c in piece)
                except KeyError:  # not in the alphabet: a token added to the model vocab as plain text
                    return piece.encode()

            return byte_level
        byte_fallback = getattr(self._tk.model, "byte_fallback", False)

        def sentencepiece(piece: str) -> bytes:
            if byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()

        return sentencepiece


@functools.cache
def _load(path: str) -> Tokenizer:
    root = Path(path)
    config_file = root / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    return Tokenizer(tokenizers.Tokenizer.from_file(str(root / "tokenizer.json")), config)


class TextStream:
    """Incremental detokenizer: push token ids, get back only the newly completed text.

    Why not decode token by token: SentencePiece-style decoders drop a token's leading space when it is decoded
    alone, and a multi-byte character may be split across byte-level tokens. Each push re-decodes a window that
    starts at an earlier clean text boundary (vLLM's approach), so the cost per token stays constant, and a trailing
    U+FFFD (an incomplete UTF-8 sequence) is held back until a later push completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        """Forget all pushed tokens."""
        self._ids: list[int] = []
        self._prefix = 0  # window start: a token boundary that is also a clean text boundary
        self._clean = 0  # the latest such boundary; becomes the window start on the next clean push
        self._sent = 0  # characters of the window's text already returned

    def push(self, tokens: Iterable[int]) -> str:
        """Append `tokens`; return the text they complete (never ending in an incomplete character)."""
        self._ids.extend(tokens)
        window = self._tokenizer.decode(self._ids[self._prefix :])
        stable = window.rstrip("\ufffd")
        delta = stable[self._sent :]
        self._sent = max(self._sent, len(stable))
        if stable == window and len(self._ids) > self._clean:
            # Clean end: slide the window up to the previous boundary, keeping one step of left context.
            self._prefix, self._clean = self._clean, len(self._ids)
            self._sent = len(self._tokenizer.decode(self._ids[self._prefix :]))
        return delta

    def text(self) -> str:
        """The full text of every pushed token, including a trailing incomplete character as U+FFFD."""
        return self._tokenizer.decode(self._ids)
