"""SDK tokenizer, instruct templates and the chat/reasoning/tools decoders, on the tiny model and family variants.

The ChatML and Llama 3 templates are checked token for token against transformers' `apply_chat_template` (the
reference for what the model was trained on); Qwen3 and Llama 3.1 turns against strings written from their
templates. Variants are the tiny tokenizer with the family's special tokens added.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from inferlet import chat, reasoning, tools
from inferlet.instruct import ChatML, Instruct, Llama3, Qwen2, Qwen3
from inferlet.tokenizer import GPT2_SPLIT_REGEX, TextStream, Tokenizer
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Meta's Llama 3 (3.0) Instruct template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# Generated replies are byte-level tokens of arbitrary text: multi-byte characters get split across tokens.
UNICODE_TEXT = "Hello, wörld! é 中文 😀 🦀 done."
plain_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


class StubModel:
    """The two members chat/reasoning/tools use from the SDK's Model."""

    def __init__(self, path: Path) -> None:
        self._tokenizer = Tokenizer.from_dir(path)
        self.instruct = Instruct.from_dir(path)

    def tokenizer(self) -> Tokenizer:
        return self._tokenizer


def _variant(src: Path, dst: Path, *, config: dict, special=(), plain=(), tokenizer_config=None, template=None):
    """A copy of the tiny model's tokenizer with family tokens added and its own config.json / chat template."""
    dst.mkdir(parents=True)
    backend = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    backend.add_special_tokens(list(special))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    if "<|begin_of_text|>" in special:  # like the real Llama 3: a Split pre-tokenizer and a BOS post-processor
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        bos = backend.token_to_id("<|begin_of_text|>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    backend.save(str(dst / "tokenizer.json"))
    tk_config = json.loads((src / "tokenizer_config.json").read_text()) | (tokenizer_config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(tk_config))
    (dst / "config.json").write_text(json.dumps(config))
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return dst


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> StubModel:
    return StubModel(tiny_llama)


@pytest.fixture(scope="module")
def qwen3(tiny_llama, tmp_path_factory) -> StubModel:
    path = _variant(
        tiny_llama,
        tmp_path_factory.mktemp("qwen3") / "m",
        config={"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        plain=QWEN3_TOKENS,
    )
    return StubModel(path)


def _llama3_dir(tiny_llama, tmp_path_factory, template: str) -> Path:
    return _variant(
        tiny_llama,
        tmp_path_factory.mktemp("llama3") / "m",
        config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        special=LLAMA3_SPECIALS,
        tokenizer_config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        template=template,
    )


@pytest.fixture(scope="module")
def llama3_path(tiny_llama, tmp_path_factory) -> Path:
    return _llama3_dir(tiny_llama, tmp_path_factory, LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def llama3(llama3_path) -> StubModel:
    return StubModel(llama3_path)


@pytest.fixture(scope="module")
def llama31(tiny_llama, tmp_path_factory) -> StubModel:
    # Only the family detection reads the template: 3.1+ templates carry the knowledge-date preamble.
    return StubModel(_llama3_dir(tiny_llama, tmp_path_factory, "{{- 'Cutting Knowledge Date: December 2023' }}"))


@functools.cache
def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_chat(hf, messages, generation_prompt=True) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=generation_prompt)["input_ids"])


def _byte_tokens(tk: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte: every multi-byte character is split across tokens."""
    ids, pieces = tk.vocabs()
    by_bytes = {piece: i for i, piece in zip(ids, pieces, strict=True)}
    return [by_bytes[bytes([b])] for b in text.encode()]


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
    assert tk3.encode(text) == list(_hf(llama3_path)(text, add_special_tokens=False)["input_ids"])


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
    tokens = _byte_tokens(tk, text) if as_bytes else tk.encode(text)
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


# --- Instruct: family selection ----------------------------------------------------------------------------------


def test_family_selection(tiny, tiny_qwen3, qwen3, llama3, llama31, tmp_path):
    assert type(tiny.instruct) is ChatML  # tiny "llama" has no Llama 3 header tokens
    assert type(Instruct.from_dir(tiny_qwen3)) is Qwen3
    assert type(qwen3.instruct) is Qwen3 and qwen3.instruct.thinking
    assert type(llama3.instruct) is Llama3 and llama3.instruct.preamble == ""
    assert llama31.instruct.preamble.startswith("Cutting Knowledge Date")
    tk = tiny.tokenizer()
    assert type(Instruct.select({"model_type": "qwen2"}, tk)) is Qwen2
    assert type(Instruct.select({"architectures": ["Qwen3MoeForCausalLM"]}, tk)) is Qwen3
    assert type(Instruct.select({"model_type": "mistral"}, tk)) is ChatML
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen3 / name, tmp_path / name)
    assert type(Instruct.from_dir(tmp_path)) is ChatML  # no config.json at all
    assert ChatML.reasoning_markers is None and Qwen2.reasoning_markers == ("<think>", "</think>")


# --- Instruct: ChatML == HF chat template ------------------------------------------------------------------------


def test_chatml_prompt_matches_hf(tiny, tiny_llama):
    hf, ins = _hf(tiny_llama), tiny.instruct
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! 中文 é 😀"}]
    assert ins.system("You are terse.") + ins.user("Hi! 中文 é 😀") + ins.cue() == _hf_chat(hf, messages)


@settings(max_examples=40, deadline=None)
@given(system=plain_text, user=plain_text, reply=plain_text, follow_up=plain_text)
def test_chatml_prefilled_turns_match_hf(tiny, tiny_llama, system, user, reply, follow_up):
    hf, ins = _hf(tiny_llama), tiny.instruct
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow_up},
    ]
    ours = ins.system(system) + ins.user(user) + ins.assistant(reply) + ins.user(follow_up) + ins.cue()
    assert ours == _hf_chat(hf, messages)


@pytest.mark.parametrize("reply", ["Hello there!", UNICODE_TEXT, "4", "Sure:\n- one\n- two"])
def test_chatml_multi_turn_keeps_kv_prefix(tiny, tiny_llama, reply):
    """Generated reply + seal() + next turn == the HF rendering of the whole conversation (no re-prefill)."""
    hf, ins, tk = _hf(tiny_llama), tiny.instruct, tiny.tokenizer()
    first = ins.system("Be brief.") + ins.user("Say hi") + ins.cue()
    # The Generator commits the reply tokens; the sampled <|im_end|> stop token never reaches the KV cache.
    conversation = first + tk.encode(reply) + ins.seal() + ins.user("Again?") + ins.cue()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Again?"},
    ]
    assert conversation == _hf_chat(hf, messages)
    assert ins.seal() == tk.encode("<|im_end|>\n")
    assert ins.stop_tokens() == [2, 0]


def test_chatml_tools(tiny):
    ins, tk = tiny.instruct, tiny.tokenizer()
    assert ins.tool_call_format.open == "<tool_call>"
    assert tools.equip_prefix(tiny, [WEATHER]) == tools.equip_prefix(tiny, [json.dumps(WEATHER)])
    assert tk.decode(tools.equip_prefix(tiny, [WEATHER])).startswith("<|im_start|>system\n# Tools\n")
    assert tools.equip_prefix(tiny, []) == []


# --- Instruct: Qwen3 ---------------------------------------------------------------------------------------------


def test_qwen3_turns(qwen3):
    ins, tk = qwen3.instruct, qwen3.tokenizer()
    prompt = ins.system("S") + ins.user("U") + ins.cue()
    assert prompt == tk.encode(
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ins.assistant("<think>\nPonder.\n</think>\n\nAnswer.") == tk.encode(
        "<|im_start|>assistant\nAnswer.<|im_end|>\n"
    )
    assert ins.assistant("No reasoning.") == tk.encode("<|im_start|>assistant\nNo reasoning.<|im_end|>\n")
    assert ins.seal() == tk.encode("<|im_end|>\n")
    assert ins.stop_tokens() == [tk.token_id("<|im_end|>"), tk.token_id("<|endoftext|>")]
    assert ins.reasoning_markers == ("<think>", "</think>")


def test_qwen3_tool_prompt_and_answer(qwen3):
    tk = qwen3.tokenizer()
    expected = (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    assert tools.equip_prefix(qwen3, [WEATHER]) == tk.encode(expected)
    response = "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
    assert tools.answer_prefix(qwen3, "get_weather", {"temp": 21, "sky": "晴"}) == tk.encode(
        response.format('{"temp": 21, "sky": "晴"}')
    )
    assert tools.answer_prefix(qwen3, "f", [1, 2]) == tk.encode(response.format("[1, 2]"))
    assert tools.answer_prefix(qwen3, "f", "sunny") == tk.encode(response.format("sunny"))


# --- Instruct: Llama 3 -------------------------------------------------------------------------------------------


def test_llama3_prompt_matches_hf(llama3, llama3_path):
    hf, ins, tk = _hf(llama3_path), llama3.instruct, llama3.tokenizer()
    prompt = ins.system("  You are terse. ") + ins.user("Hi! 中文\n") + ins.cue()
    messages = [{"role": "system", "content": "  You are terse. "}, {"role": "user", "content": "Hi! 中文\n"}]
    assert prompt == _hf_chat(hf, messages)
    reply = "Hello there! é 😀"
    conversation = prompt + tk.encode(reply) + ins.seal() + ins.user("Again?") + ins.cue()
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again?"}]
    assert conversation == _hf_chat(hf, messages)
    assert ins.seal() == [tk.token_id("<|eot_id|>")]
    assert ins.stop_tokens() == [tk.token_id(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")]


def test_llama31_system_tools_and_answer(llama31):
    ins, tk = llama31.instruct, llama31.tokenizer()
    preamble = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    assert ins.system(" S ") == tk.encode(
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{preamble}S<|eot_id|>"
    )
    expected_tools = (
        f"<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n{preamble}"
        "You have access to the following functions. To call a function, please respond with JSON for a function "
        'call.Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        "value}.Do not use variables.\n\n" + json.dumps(WEATHER, indent=4, ensure_ascii=False) + "\n\n<|eot_id|>"
    )
    assert tools.equip_prefix(llama31, [WEATHER]) == tk.encode(expected_tools)
    assert tools.answer_prefix(llama31, "get_weather", {"temp": 21}) == tk.encode(
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}<|eot_id|>'
    )
    assert ins.tool_call_format.open is None and ins.tool_call_format.args_key == "parameters"


# --- chat.Decoder ------------------------------------------------------------------------------------------------


def _drive(decoder, tokens, step=1):
    return [decoder.feed(tokens[i : i + step]) for i in range(0, len(tokens), step)]


@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_chat_decoder_streams_utf8_token_by_token(tiny, split):
    tk = tiny.tokenizer()
    tokens = tk.encode(UNICODE_TEXT) if split == "bpe" else _byte_tokens(tk, UNICODE_TEXT)
    decoder = chat.Decoder(tiny)
    events = _drive(decoder, tokens)
    deltas = [e.text for e in events if isinstance(e, chat.Event.Delta)]
    assert "".join(deltas) == UNICODE_TEXT
    assert not any("\ufffd" in d for d in deltas)
    if split == "bytes":  # the continuation bytes of é, 中, 文, 😀, 🦀 produce nothing visible
        assert sum(isinstance(e, chat.Event.Idle) for e in events) == sum(len(c.encode()) - 1 for c in UNICODE_TEXT)
    assert decoder.feed([tk.token_id("<|im_end|>")]) == chat.Event.Done(UNICODE_TEXT)
    # Done reset the decoder: the next turn starts from scratch.
    assert decoder.feed(tk.encode("Next")) == chat.Event.Delta("Next")
    assert decoder.feed([0]) == chat.Event.Done("Next")  # <|endoftext|> also ends the turn


def test_chat_decoder_events_and_match(tiny):
    tk = tiny.tokenizer()
    decoder = chat.Decoder(tiny)
    seen = []
    for batch in ([*tk.encode("Hi"), 1], [], tk.encode(" there"), [], [2]):
        match decoder.feed(batch):
            case chat.Event.Delta(text=t):
                seen.append(("delta", t))
            case chat.Event.Done(t):
                seen.append(("done", t))
            case chat.Event.Interrupt(token=tid):
                seen.append(("interrupt", tid))
            case chat.Event.Idle():
                seen.append(("idle",))
    # <|im_start|> is a control token: reported, kept out of the text; "Hi" from its batch follows next feed.
    assert seen == [("interrupt", 1), ("delta", "Hi"), ("delta", " there"), ("idle",), ("done", "Hi there")]
    assert isinstance(chat.Event.Idle(), chat.Event)


def test_chat_decoder_batches_and_reset(tiny):
    tk = tiny.tokenizer()
    decoder = chat.Decoder(tiny)
    tokens = _byte_tokens(tk, "中文")
    assert decoder.feed(tokens[:4]) == chat.Event.Delta("中")  # the half of 文 is held back
    decoder.reset()
    assert decoder.feed(tokens[4:]) == chat.Event.Idle()
    assert decoder.feed([*tk.encode("ok"), 2, *tk.encode("dropped")]) == chat.Event.Done("\ufffd\ufffdok")
    assert decoder.feed([]) == chat.Event.Idle()


def test_chat_decoder_llama3_controls(llama3):
    tk = llama3.tokenizer()
    decoder = chat.Decoder(llama3)
    python_tag, eom = tk.token_id("<|python_tag|>"), tk.token_id("<|eom_id|>")
    assert decoder.feed([python_tag]) == chat.Event.Interrupt(python_tag)
    assert decoder.feed(tk.encode("x = 1")) == chat.Event.Delta("x = 1")
    assert decoder.feed([eom]) == chat.Event.Done("x = 1")
    assert chat.stop_tokens(llama3) == llama3.instruct.stop_tokens()
    assert chat.cue(llama3) + chat.seal(llama3) == llama3.instruct.cue() + llama3.instruct.seal()


def test_chat_helpers(tiny):
    ins = tiny.instruct
    assert chat.system(tiny, "s") == ins.system("s")
    assert chat.user(tiny, "u") == ins.user("u")
    assert chat.assistant(tiny, "a") == ins.assistant("a")


# --- reasoning.Decoder -------------------------------------------------------------------------------------------

THOUGHT = "\nLet me think: é 中文 😀\n"
REPLY = f"<think>{THOUGHT}</think>\n\nThe answer."


@pytest.mark.parametrize("variant", ["qwen3", "tiny_qwen3"])
@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_reasoning_decoder_token_by_token(qwen3, tiny_qwen3, variant, split):
    # qwen3: <think> is one added token; tiny_qwen3: the markers are spelled with ordinary tokens.
    model = qwen3 if variant == "qwen3" else StubModel(tiny_qwen3)
    tk = model.tokenizer()
    if split == "bpe":
        tokens = tk.encode(REPLY)
    else:
        tokens = tk.encode("<think>") + _byte_tokens(tk, THOUGHT) + tk.encode("</think>\n\nThe answer.")
    events = _drive(reasoning.Decoder(model), tokens)
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("Start") == 1 and kinds.count("End") == 1
    assert kinds.index("Start") < kinds.index("End")
    assert set(kinds[kinds.index("End") + 1 :]) == {"Idle"}
    deltas = "".join(e.text for e in events if isinstance(e, reasoning.Event.Delta))
    assert THOUGHT.startswith(deltas) and len(deltas) >= len(THOUGHT) - 1  # at most a "\n" waits for the End
    end = next(e for e in events if isinstance(e, reasoning.Event.End))
    assert end == reasoning.Event.End(THOUGHT)


def test_reasoning_decoder_batches(qwen3):
    tk = qwen3.tokenizer()
    decoder = reasoning.Decoder(qwen3)
    assert decoder.feed(tk.encode(REPLY)) == reasoning.Event.End(THOUGHT)  # End outranks Start in one batch
    assert decoder.feed([]) == reasoning.Event.Idle()
    decoder.reset()
    assert decoder.feed(tk.encode("Plan: <think>step one")) == reasoning.Event.Start()
    assert decoder.feed([]) == reasoning.Event.Delta("step one")
    assert decoder.feed(tk.encode(", two</think> ok")) == reasoning.Event.End("step one, two")
    decoder.reset()
    match decoder.feed(tk.encode("no reasoning here")):
        case reasoning.Event.Idle():
            pass
        case other:
            pytest.fail(f"unexpected {other}")


def test_reasoning_decoder_without_markers_is_idle(tiny):
    decoder = reasoning.Decoder(tiny)
    assert decoder.feed(tiny.tokenizer().encode(REPLY)) == reasoning.Event.Idle()


# --- tools.Decoder -----------------------------------------------------------------------------------------------

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "é 中文"}}\n</tool_call>'
CALL_ARGS = json.dumps({"city": "Paris", "note": "é 中文"}, ensure_ascii=False)


@pytest.mark.parametrize("variant", ["qwen3", "tiny"])
def test_tool_decoder_qwen_format_token_by_token(qwen3, tiny, variant):
    model = qwen3 if variant == "qwen3" else tiny  # tiny ChatML: the tags are spelled with ordinary tokens
    tk = model.tokenizer()
    events = _drive(tools.Decoder(model), tk.encode("Let me check. " + QWEN_CALL))
    kinds = [type(e).__name__ for e in events]
    assert kinds[-1] == "Call" and kinds.count("Call") == 1
    assert kinds[0] == "Idle" and "Start" in kinds
    assert set(kinds[kinds.index("Start") : -1]) == {"Start"}
    assert events[-1] == tools.Event.Call("get_weather", CALL_ARGS)


def test_tool_decoder_qwen_multiple_and_malformed(qwen3):
    tk = qwen3.tokenizer()
    decoder = tools.Decoder(qwen3)
    second = QWEN_CALL.replace("get_weather", "get_time")
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert decoder.feed(tk.encode(QWEN_CALL + "\n" + broken + "\n" + second)) == tools.Event.Call(
        "get_weather", CALL_ARGS
    )
    match decoder.feed([]):
        case tools.Event.Call(name, args):
            assert (name, json.loads(args)) == ("get_time", {"city": "Paris", "note": "é 中文"})
        case other:
            pytest.fail(f"unexpected {other}")
    assert decoder.feed([]) == tools.Event.Idle()
    decoder.reset()
    assert decoder.feed(tk.encode('<tool_call>\n{"name": "f"}\n</tool_call>')) == tools.Event.Call("f", "{}")


@pytest.mark.parametrize("variant", ["qwen3", "llama3"])
def test_a_call_written_by_call_text_is_what_the_decoder_reads(qwen3, llama3, variant):
    """``call_text`` replays an earlier turn's call in the family's syntax: the family's own decoder reads it back,
    with the arguments whether given as JSON text or as a dict; the ChatML text is the hand-written one above."""
    model = qwen3 if variant == "qwen3" else llama3
    for arguments in (CALL_ARGS, json.loads(CALL_ARGS)):
        text = tools.call_text(model, "get_weather", arguments)
        assert tools.Decoder(model).feed(model.tokenizer().encode(text)) == tools.Event.Call("get_weather", CALL_ARGS)
    if variant == "qwen3":
        assert json.loads(tools.call_text(model, "get_weather", CALL_ARGS).split("\n")[1]) == json.loads(
            QWEN_CALL.split("\n")[1]
        )


def test_tool_decoder_llama3_format(llama3):
    tk = llama3.tokenizer()
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "note": "é 中文"}}'
    events = _drive(tools.Decoder(llama3), [tk.token_id("<|python_tag|>"), *tk.encode(call)])
    assert events[-1] == tools.Event.Call("get_weather", CALL_ARGS)
    assert {type(e).__name__ for e in events[1:-1]} == {"Start"}

    decoder = tools.Decoder(llama3)
    assert decoder.feed(tk.encode("The weather is {sunny}.")) == tools.Event.Idle()  # plain text, not a call
    decoder.reset()
    both = tk.encode(call + "; " + call.replace("get_weather", "get_time"))
    assert decoder.feed(both) == tools.Event.Call("get_weather", CALL_ARGS)
    assert decoder.feed([]) == tools.Event.Call("get_time", CALL_ARGS)
    assert decoder.feed([tk.token_id("<|eom_id|>")]) == tools.Event.Idle()
