"""The SDK's Tokenizer on the tiny model and a Llama 3 variant: special tokens split out of text and kept on decode,
vocab bytes round-tripping, the split regex, a SentencePiece-style vocab, streaming decode under any batching,
caching per directory, and an SDK import that stays light.
"""

from __future__ import annotations

import subprocess
import sys

import tokenizers
from chat_models import LLAMA3_SPECIALS, LLAMA3_SPLIT, byte_tokens, hf_tokenizer, plain_text
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from inferlet import chat
from inferlet.instruct import Instruct
from inferlet.tokenizer import GPT2_SPLIT_REGEX, TextStream, Tokenizer
from tokenizers import decoders, models, normalizers

# --- Tokenizer -------------------------------------------------------------------------------------------------


def test_encode_splits_literal_special_tokens_and_adds_no_bos(tiny, llama3, llama3_path):
    tk = tiny.tokenizer()
    assert tk.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tk.encode("user\nhi"), 2]
    assert tk.encode("a<|endoftext|>b") == [*tk.encode("a"), 0, *tk.encode("b")]
    assert tk.encode("") == []
    # The Llama 3 variant's post-processor adds <|begin_of_text|>, as the real one does; encode must not.
    tk3 = llama3.tokenizer()
    bos = tk3.token_id("<|begin_of_text|>")
    text = "Hi there<|eot_id|>"
    assert bos not in tk3.encode(text)
    assert tokenizers.Tokenizer.from_file(str(llama3_path / "tokenizer.json")).encode(text).ids[0] == bos
    assert tk3.encode(text) == list(hf_tokenizer(llama3_path)(text, add_special_tokens=False)["input_ids"])


def test_decode_keeps_special_tokens(tiny):
    tk = tiny.tokenizer()
    text = "<|im_start|>assistant\nHi é 中文<|im_end|>\n"
    assert tk.decode(tk.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(text=plain_text)
def test_vocab_bytes_round_trip(tiny, llama3, text):
    for model in (tiny, llama3):
        tk = model.tokenizer()
        _, pieces = tk.vocabs()
        assert b"".join(pieces[t] for t in tk.encode(text)) == text.encode()


def test_vocabs_and_special_tokens(tiny, llama3, qwen3):
    tk = tiny.tokenizer()
    ids, pieces = tk.vocabs()
    assert ids == list(range(4096)) == list(range(tk.vocab_size))
    assert pieces[:3] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    assert len(set(pieces)) == len(pieces)  # byte-level: every token is a distinct byte string
    assert all(bytes([b]) in pieces for b in range(256))
    assert tk.special_tokens() == ([0, 1, 2], [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"])
    assert tk.token_id("<|im_end|>") == 2 and tk.token_id("no such token") is None

    special_ids, special_bytes = llama3.tokenizer().special_tokens()
    assert [b.decode() for b in special_bytes] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *LLAMA3_SPECIALS]
    assert special_ids == list(range(3)) + list(range(4096, 4096 + len(LLAMA3_SPECIALS)))

    # Qwen's <think>/<tool_call> are added tokens but not special: they decode as text, not as control tokens.
    tq = qwen3.tokenizer()
    think = tq.token_id("<think>")
    assert tq.encode("<think>hm</think>")[0] == think
    assert think not in tq.special_tokens()[0]
    assert tq.vocabs()[1][think] == b"<think>"


def test_split_regex(tiny, llama3):
    assert tiny.tokenizer().split_regex() == GPT2_SPLIT_REGEX
    assert llama3.tokenizer().split_regex() == LLAMA3_SPLIT


def _sentencepiece_like() -> Tokenizer:
    """A Llama-2-style tokenizer: `▁` for spaces, byte fallback, and a decoder that strips the first space."""
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    for piece in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(backend)


def test_sentencepiece_style_vocab_and_stream():
    tk = _sentencepiece_like()
    text = "hello world é 中"
    tokens = tk.encode(text)
    _, pieces = tk.vocabs()
    assert b"".join(pieces[t] for t in tokens) == b" " + text.encode()  # the normalizer's leading "▁"
    assert pieces[1 + 0xC3] == b"\xc3"
    assert tk.split_regex() == ""
    # Decoding tokens one at a time would lose every space (Strip) and show U+FFFD for byte-fallback pieces.
    assert "".join(tk.decode([t]) for t in tokens) != text
    stream = TextStream(tk)
    deltas = [stream.push([t]) for t in tokens]
    assert "".join(deltas) == text == stream.text()
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@example(text="<|im_start|>", cuts=[], as_bytes=False)  # a special token's literal text is control, not text
@given(
    text=st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=40),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    as_bytes=st.booleans(),
)
def test_chat_decoder_any_batching(tiny, text, cuts, as_bytes):
    tk = tiny.tokenizer()
    # literal special-token text encodes to the special token itself, which the decoder reports as control
    assume(not any(special.decode() in text for special in tk.special_tokens()[1]))
    tokens = byte_tokens(tk, text) if as_bytes else tk.encode(text)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c < len(tokens))})
    decoder = chat.Decoder(tiny)
    events = [decoder.feed(tokens[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert "".join(e.text for e in events if isinstance(e, chat.Event.Delta)) == text
    assert decoder.feed([2]) == chat.Event.Done(text)


def test_tokenizer_and_instruct_are_cached_per_directory(tiny_llama):
    assert Tokenizer.from_dir(tiny_llama) is Tokenizer.from_dir(str(tiny_llama) + "/")
    assert Instruct.from_dir(tiny_llama) is Instruct.from_dir(tiny_llama)


def test_sdk_import_stays_light():
    code = (
        "import sys, inferlet.chat, inferlet.reasoning, inferlet.tools; "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
