"""Per-family chat templates that produce token lists, so inferlets build prompts turn by turn.

Why hand-written families instead of rendering the model's Jinja template: an inferlet appends one turn at a time to
a live KV cache, so each turn must tokenize on its own to exactly the ids the full-conversation template would give.
Every turn here is rendered to one string (special tokens written literally) and encoded in one call; each turn
starts with a special token and ends right after one (plus "\\n" for ChatML), which is where the template's text
is split anyway, so concatenated turns equal the HF rendering of the whole conversation token for token.

Family choice mirrors Pie's `instruct::create`, but reads `config.json` (`model_type`, `architectures`) so HF
architecture names are normalised: qwen3* -> `Qwen3` (thinking), qwen2* -> `Qwen2`, llama with Llama 3 special
tokens in the vocabulary -> `Llama3`, anything else -> plain `ChatML`.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from inferlet.tokenizer import Tokenizer

THINK_MARKERS = ("<think>", "</think>")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family writes a tool call, so a single `tools.Decoder` parses them all.

    `open`/`close` delimit each call (Qwen's `<tool_call>` tags); when they are None the whole reply is one bare JSON
    object (Llama 3). `args_key` names the arguments member of that object.
    """

    open: str | None
    close: str | None
    args_key: str


QWEN_TOOL_CALLS = ToolCallFormat("<tool_call>", "</tool_call>", "arguments")
LLAMA3_TOOL_CALLS = ToolCallFormat(None, None, "parameters")

# Qwen2.5/Qwen3's tool prompt, verbatim from their chat templates (also used for plain ChatML: any format is a guess
# for an unknown model, and this one is what `tools.Decoder` parses for it).
_QWEN_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
# Llama 3.1's custom-tool prompt (the `tools_in_user_message=false` placement: a system turn).
_LLAMA3_TOOLS_HEAD = (
    "You have access to the following functions. To call a function, please respond with JSON for a function call."
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)
# Llama 3.1+ templates open the system turn with this; detected in the model's template (3.0 has none).
_LLAMA31_PREAMBLE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def _tool_dicts(tools: list[dict | str]) -> list[Any]:
    """Schemas given as JSON text are parsed so every schema is re-serialised the way the template's tojson does."""
    return [json.loads(t) if isinstance(t, str) else t for t in tools]


class Instruct(ABC):
    """A model family's chat template as token lists. Subclasses fill in the family's strings."""

    family = "base"
    thinking = False  # the template is built for `<think>` reasoning (assistant() strips it, as Qwen3's does)
    reasoning_markers: tuple[str, str] | None = None  # the text that opens/closes a reasoning block, if any
    tool_call_format = QWEN_TOOL_CALLS
    stop_names: tuple[str, ...] = ()  # vocabulary entries that end a turn
    cue_text = ""  # what opens the assistant turn the model generates
    seal_text = ""  # what the template renders after an assistant message's text

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = [tokenizer.token_id(name) for name in self.stop_names] + [tokenizer.eos_token_id]
        self._stops = list(dict.fromkeys(i for i in ids if i is not None))
        self._cue = tokenizer.encode(self.cue_text)
        self._seal = tokenizer.encode(self.seal_text)

    @staticmethod
    def from_dir(path: str | Path) -> Instruct:
        """The family template for a HF model directory (config.json + tokenizer files); cached per directory."""
        return _load(str(Path(path).resolve()))

    @staticmethod
    def select(config: dict, tokenizer: Tokenizer, chat_template: str = "") -> Instruct:
        """Pick the family from a parsed config.json; `chat_template` (the model's Jinja text) refines Llama 3."""
        names = [str(config.get("model_type") or "").lower(), *(a.lower() for a in config.get("architectures") or [])]
        if any(n.startswith("qwen3") for n in names):
            return Qwen3(tokenizer)
        if any(n.startswith("qwen2") for n in names):
            return Qwen2(tokenizer)
        if any("llama" in n for n in names) and tokenizer.token_id("<|start_header_id|>") is not None:
            return Llama3(tokenizer, preamble=_LLAMA31_PREAMBLE if "Cutting Knowledge Date" in chat_template else "")
        return ChatML(tokenizer)

    @abstractmethod
    def system(self, text: str) -> list[int]:
        """A system turn."""

    @abstractmethod
    def user(self, text: str) -> list[int]:
        """A user turn."""

    @abstractmethod
    def assistant(self, text: str) -> list[int]:
        """A pre-filled, closed assistant turn."""

    def cue(self) -> list[int]:
        """Opens the assistant turn the model is about to generate."""
        return list(self._cue)

    def seal(self) -> list[int]:
        """Closes a generated assistant turn exactly as the template renders the end of an assistant message.

        Why not Pie's `seal` (= every stop id, e.g. `<|im_end|><|endoftext|>`): the Generator never writes the
        sampled stop token into the KV cache, so `seal()` must append the template's turn ending and nothing else,
        or the cached conversation diverges from what the model was trained on (and from a re-rendered prompt).
        """
        return list(self._seal)

    def stop_tokens(self) -> list[int]:
        """Ids that end a turn (those present in the vocabulary), plus the tokenizer's EOS."""
        return list(self._stops)

    @abstractmethod
    def equip(self, tools: list[dict | str]) -> list[int]:
        """A turn that makes the tool schemas (dicts or JSON strings) available; [] for no tools."""

    @abstractmethod
    def answer(self, name: str, value: str) -> list[int]:
        """A turn carrying a tool's result back to the model."""


class ChatML(Instruct):
    """`<|im_start|>role\\n…<|im_end|>\\n` turns: the embedded tiny model and any unknown model."""

    family = "chatml"
    stop_names = ("<|im_end|>", "<|endoftext|>")
    cue_text = "<|im_start|>assistant\n"
    seal_text = "<|im_end|>\n"

    def _turn(self, role: str, text: str) -> list[int]:
        return self.tokenizer.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n")

    def system(self, text: str) -> list[int]:
        return self._turn("system", text)

    def user(self, text: str) -> list[int]:
        return self._turn("user", text)

    def assistant(self, text: str) -> list[int]:
        return self._turn("assistant", text)

    def equip(self, tools: list[dict | str]) -> list[int]:
        """Qwen's tool system turn, as its template renders it when the conversation has no system message."""
        if not tools:
            return []
        listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in _tool_dicts(tools))
        return self._turn("system", _QWEN_TOOLS_HEAD + listing + _QWEN_TOOLS_TAIL)

    def answer(self, name: str, value: str) -> list[int]:
        """Qwen renders a `tool` message as a user turn wrapping the result; the tool's name is not shown."""
        return self._turn("user", f"<tool_response>\n{value}\n</tool_response>")


class Qwen2(ChatML):
    """Qwen2/2.5: ChatML with Qwen tool calls; no thinking template (R1 distills still emit `<think>`)."""

    family = "qwen2"
    reasoning_markers = THINK_MARKERS


class Qwen3(ChatML):
    """Qwen3: ChatML whose replayed assistant turns drop their reasoning, as Qwen3's template does."""

    family = "qwen3"
    thinking = True
    reasoning_markers = THINK_MARKERS

    def assistant(self, text: str) -> list[int]:
        """Keeps only what follows the last `</think>` (leading newlines stripped), like Qwen3's template."""
        end = THINK_MARKERS[1]
        if end in text:
            text = text.rsplit(end, 1)[1].lstrip("\n")
        return super().assistant(text)


class Llama3(Instruct):
    """`<|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>` turns (Llama 3.x Instruct).

    `system()` opens with `<|begin_of_text|>`: the HF template starts every conversation with it and with a system
    turn, while Pie never sent one. A conversation that starts without `system()` therefore has no BOS.
    Message text is trimmed, as the template's `| trim` does.
    """

    family = "llama3"
    reasoning_markers = THINK_MARKERS
    tool_call_format = LLAMA3_TOOL_CALLS
    stop_names = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    cue_text = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    seal_text = "<|eot_id|>"

    def __init__(self, tokenizer: Tokenizer, preamble: str = "") -> None:
        """`preamble`: the knowledge-date lines that Llama 3.1+ templates put at the top of the system turn."""
        super().__init__(tokenizer)
        self.preamble = preamble

    def _turn(self, role: str, text: str) -> list[int]:
        return self.tokenizer.encode(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")

    def system(self, text: str) -> list[int]:
        return self.tokenizer.encode("<|begin_of_text|>") + self._turn("system", self.preamble + text.strip())

    def user(self, text: str) -> list[int]:
        return self._turn("user", text.strip())

    def assistant(self, text: str) -> list[int]:
        return self._turn("assistant", text.strip())

    def equip(self, tools: list[dict | str]) -> list[int]:
        """The system turn Llama 3.1's template renders for tools with an empty system message (no BOS here)."""
        if not tools:
            return []
        listing = "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in _tool_dicts(tools))
        return self._turn("system", "Environment: ipython\n" + self.preamble + _LLAMA3_TOOLS_HEAD + listing)

    def answer(self, name: str, value: str) -> list[int]:
        """Tool results go in an `ipython` turn; the tool's name is not shown, as in the template."""
        return self._turn("ipython", value)


class ModelLike(Protocol):
    """What chat/reasoning/tools helpers need from a model: the SDK's `Model` provides exactly this."""

    instruct: Instruct

    def tokenizer(self) -> Tokenizer: ...


def _chat_template(root: Path) -> str:
    """The model's Jinja chat template text ("" if none): chat_template.jinja, else tokenizer_config.json's."""
    jinja = root / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config_file = root / "tokenizer_config.json"
    template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template") if config_file.exists() else ""
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = "".join(t.get("template", "") for t in template)
    return template or ""


@functools.cache
def _load(path: str) -> Instruct:
    root = Path(path)
    config_file = root / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    return Instruct.select(config, Tokenizer.from_dir(root), _chat_template(root))
