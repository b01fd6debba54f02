"""The SDK's streaming decoders on token streams of the tiny model and family variants: chat.Decoder (UTF-8 split
across tokens, events, batching, Llama 3 controls), reasoning.Decoder (thoughts in <think> markers) and
tools.Decoder (Qwen and Llama 3 call formats, several calls, malformed ones, and what call_text writes).
"""

from __future__ import annotations

import json

import pytest
from chat_models import UNICODE_TEXT, StubModel, byte_tokens
from inferlet import chat, reasoning, tools

# --- chat.Decoder ------------------------------------------------------------------------------------------------


def _drive(decoder, tokens, step=1):
    return [decoder.feed(tokens[i : i + step]) for i in range(0, len(tokens), step)]


@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_chat_decoder_streams_utf8_token_by_token(tiny, split):
    tk = tiny.tokenizer()
    tokens = tk.encode(UNICODE_TEXT) if split == "bpe" else byte_tokens(tk, UNICODE_TEXT)
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
    tokens = byte_tokens(tk, "中文")
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
        tokens = tk.encode("<think>") + byte_tokens(tk, THOUGHT) + tk.encode("</think>\n\nThe answer.")
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


def test_a_call_cut_off_mid_arguments_is_pending_with_its_arguments_so_far(qwen3, llama3):
    llama_call = '{"name": "get_weather", "parameters": {"city": "Paris", "note": "é 中文"}}'
    for model, text in ((qwen3, QWEN_CALL), (llama3, llama_call)):
        tk = model.tokenizer()
        for cut in range(1, len(text)):
            decoder = tools.Decoder(model)
            event = decoder.feed(tk.encode(text[:cut]))
            pending = decoder.pending()
            if event != tools.Event.Start():
                assert pending is None
                continue
            if pending is not None:  # once its name is whole: the name, and a prefix of the arguments' text
                assert pending.name == "get_weather" and CALL_ARGS.startswith(pending.args), pending
        assert decoder.pending() is not None  # one character short of the whole call
    decoder = tools.Decoder(qwen3)
    assert decoder.feed(qwen3.tokenizer().encode('<tool_call>\n{"name": "get_wea')) == tools.Event.Start()
    assert decoder.pending() is None  # its name is not whole: no call to report
