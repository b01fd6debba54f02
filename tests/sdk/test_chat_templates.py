"""The SDK's instruct templates: which family a model directory selects, then each family's turns.

ChatML and Llama 3 are checked token for token against transformers' `apply_chat_template` (the reference for what
the model was trained on); Qwen3 and Llama 3.1 turns, tool prompts and answers against strings written from their
templates. Variants are the tiny tokenizer with the family's special tokens added.
"""

from __future__ import annotations

import json
import shutil

import pytest
from chat_models import UNICODE_TEXT, WEATHER, hf_chat, hf_tokenizer, plain_text
from hypothesis import given, settings
from inferlet import tools
from inferlet.instruct import ChatML, Instruct, Llama3, Qwen2, Qwen3

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


def test_chatml_prompt_matcheshf_tokenizer(tiny, tiny_llama):
    hf, ins = hf_tokenizer(tiny_llama), tiny.instruct
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! 中文 é 😀"}]
    assert ins.system("You are terse.") + ins.user("Hi! 中文 é 😀") + ins.cue() == hf_chat(hf, messages)


@settings(max_examples=40, deadline=None)
@given(system=plain_text, user=plain_text, reply=plain_text, follow_up=plain_text)
def test_chatml_prefilled_turns_matchhf_tokenizer(tiny, tiny_llama, system, user, reply, follow_up):
    hf, ins = hf_tokenizer(tiny_llama), tiny.instruct
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow_up},
    ]
    ours = ins.system(system) + ins.user(user) + ins.assistant(reply) + ins.user(follow_up) + ins.cue()
    assert ours == hf_chat(hf, messages)


@pytest.mark.parametrize("reply", ["Hello there!", UNICODE_TEXT, "4", "Sure:\n- one\n- two"])
def test_chatml_multi_turn_keeps_kv_prefix(tiny, tiny_llama, reply):
    """Generated reply + seal() + next turn == the HF rendering of the whole conversation (no re-prefill)."""
    hf, ins, tk = hf_tokenizer(tiny_llama), tiny.instruct, tiny.tokenizer()
    first = ins.system("Be brief.") + ins.user("Say hi") + ins.cue()
    # The Generator commits the reply tokens; the sampled <|im_end|> stop token never reaches the KV cache.
    conversation = first + tk.encode(reply) + ins.seal() + ins.user("Again?") + ins.cue()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Again?"},
    ]
    assert conversation == hf_chat(hf, messages)
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


def test_llama3_prompt_matcheshf_tokenizer(llama3, llama3_path):
    hf, ins, tk = hf_tokenizer(llama3_path), llama3.instruct, llama3.tokenizer()
    prompt = ins.system("  You are terse. ") + ins.user("Hi! 中文\n") + ins.cue()
    messages = [{"role": "system", "content": "  You are terse. "}, {"role": "user", "content": "Hi! 中文\n"}]
    assert prompt == hf_chat(hf, messages)
    reply = "Hello there! é 😀"
    conversation = prompt + tk.encode(reply) + ins.seal() + ins.user("Again?") + ins.cue()
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again?"}]
    assert conversation == hf_chat(hf, messages)
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
