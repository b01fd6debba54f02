"""Test helper for the SDK's tokenizer, chat-template and decoder tests: the tiny model's tokenizer as the SDK's
Model shows it, family variants of it (Qwen3's and Llama 3's special tokens and templates), and transformers'
tokenizer as the reference."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import tokenizers
from hypothesis import strategies as st
from inferlet.instruct import Instruct
from inferlet.tokenizer import Tokenizer
from tokenizers import AddedToken, pre_tokenizers, processors

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


def variant(src: Path, dst: Path, *, config: dict, special=(), plain=(), tokenizer_config=None, template=None):
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


def llama3_dir(tiny_llama, tmp_path_factory, template: str) -> Path:
    return variant(
        tiny_llama,
        tmp_path_factory.mktemp("llama3") / "m",
        config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
        special=LLAMA3_SPECIALS,
        tokenizer_config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        template=template,
    )


@functools.cache
def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_chat(hf, messages, generation_prompt=True) -> list[int]:
    return list(hf.apply_chat_template(messages, add_generation_prompt=generation_prompt)["input_ids"])


def byte_tokens(tk: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte: every multi-byte character is split across tokens."""
    ids, pieces = tk.vocabs()
    by_bytes = {piece: i for i, piece in zip(ids, pieces, strict=True)}
    return [by_bytes[bytes([b])] for b in text.encode()]
