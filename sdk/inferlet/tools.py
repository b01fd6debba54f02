"""Tool use: prompt prefixes that equip tools and return results, and a streaming tool-call parser.

The call syntax comes from the model's family (`Instruct.tool_call_format`): Qwen/ChatML write
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Llama 3 replies with a bare
`{"name": ..., "parameters": {...}}`. Calls are recognised on decoded text as soon as their JSON is complete, so the
parser does not need to see the end-of-turn token (the Generator strips stop tokens before handing tokens out).
`native_matcher` enforces the same syntax while generating.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from inferlet.grammar import Grammar, Matcher
from inferlet.instruct import ModelLike
from inferlet.tokenizer import TextStream

_JSON = json.JSONDecoder()
_ARGS_KEYS = ("arguments", "parameters")
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"(?:' + "|".join(_ARGS_KEYS) + r')"\s*:\s*')


def equip_prefix(model: ModelLike, schemas: Iterable[dict | str]) -> list[int]:
    """Tokens of the turn that registers tool schemas (dicts or JSON strings); append before the user message."""
    return model.instruct.equip(list(schemas))


def answer_prefix(model: ModelLike, name: str, value: Any) -> list[int]:
    """Tokens of the turn that returns a tool's result; non-string values are JSON-encoded."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return model.instruct.answer(name, text)


def call_text(model: ModelLike, name: str, arguments: str | dict) -> str:
    """A call as the model writes it in its family's syntax (to replay an earlier turn's calls); ``arguments`` is
    JSON text or a dict."""
    fmt = model.instruct.tool_call_format
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        args = arguments  # not JSON: kept as the text it is
    call = json.dumps({"name": name, fmt.args_key: args}, ensure_ascii=False)
    return f"{fmt.open}\n{call}\n{fmt.close}" if fmt.open else call


def native_matcher(model: ModelLike, schemas: Iterable[dict | str]) -> Matcher | None:
    """A Matcher for tool calls in the model's native syntax, naming one of ``schemas`` with arguments matching its
    ``parameters``; wrap it in ``GrammarConstraint`` to constrain a Generator.

    Every family here has an enforceable syntax (Qwen-style tagged calls, newline-separated; Llama 3's single bare
    object), so this returns a Matcher; None is reserved for models without one, as in Pie's API. The JSON is
    compact, in schema property order, as the chat templates render calls.
    """
    fmt = model.instruct.tool_call_format
    calls = [_call_schema(s, fmt.args_key) for s in schemas]
    if not calls:
        raise ValueError("native_matcher needs at least one tool schema")
    schema = {"anyOf": calls}
    if fmt.open:
        grammar = Grammar._tagged_json(schema, f"{fmt.open}\n", f"\n{fmt.close}", "\n")
    else:
        grammar = Grammar.from_json_schema(schema)
    return Matcher(grammar, model.tokenizer(), stop_tokens=model.instruct.stop_tokens())


def _call_schema(tool: dict | str, args_key: str) -> dict:
    """JSON Schema of one call to ``tool`` (an OpenAI-style ``{"type": "function", "function": ...}`` or bare)."""
    spec = json.loads(tool) if isinstance(tool, str) else tool
    spec = spec.get("function", spec)
    if not isinstance(spec.get("name"), str):
        raise ValueError(f"tool schema has no string 'name': {json.dumps(spec)[:200]}")
    return {
        "type": "object",
        "properties": {"name": {"const": spec["name"]}, args_key: spec.get("parameters", {"type": "object"})},
        "required": ["name", args_key],
    }


class Event:
    """What one `Decoder.feed` produced; match on `Event.Idle()`, `Event.Start()`, `Event.Call(name, args)`."""

    __slots__ = ()
    Idle: ClassVar[type[Idle]]
    Start: ClassVar[type[Start]]
    Call: ClassVar[type[Call]]


@dataclass(frozen=True, slots=True)
class Idle(Event):
    """No tool call is being written (plain text so far). Pie reports this as `Start`; kept distinct here."""


@dataclass(frozen=True, slots=True)
class Start(Event):
    """A tool call is being written but is not complete yet."""


@dataclass(frozen=True, slots=True)
class Call(Event):
    """A complete tool call; `args` is its arguments as a JSON string."""

    name: str
    args: str


Event.Idle, Event.Start, Event.Call = Idle, Start, Call


class Decoder:
    """Finds tool calls in the generated token stream; one event per `feed`.

    Several calls completed by one batch are reported one per feed (call `feed([])` to drain them). Text between
    the call tags that is not a JSON object with a string `name` is skipped.
    """

    def __init__(self, model: ModelLike) -> None:
        tokenizer = model.tokenizer()
        self._format = model.instruct.tool_call_format
        self._special = tokenizer.special_ids
        self._stream = TextStream(tokenizer)
        self.reset()

    def reset(self) -> None:
        """Forget all state (call between turns)."""
        self._stream.reset()
        self._text = ""
        self._pos = 0  # everything before this offset has been reported or ruled out

    def feed(self, tokens: Iterable[int]) -> Event:
        """Consume the tokens of one generation step."""
        self._text += self._stream.push(t for t in tokens if t not in self._special)
        return self._tagged() if self._format.open else self._bare()

    def _tagged(self) -> Event:
        """Qwen style: each call sits between the open and close tags."""
        open_, close = self._format.open, self._format.close
        while True:
            at = self._text.find(open_, self._pos)
            if at < 0:
                # No tag starts before here: later searches can skip it (keeps long replies linear).
                self._pos = max(self._pos, len(self._text) - len(open_) + 1)
                return Idle()
            self._pos = at
            end = self._text.find(close, at + len(open_))
            if end < 0:
                return Start()
            self._pos = end + len(close)
            try:
                call = self._call(json.loads(self._text[at + len(open_) : end]))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                return call

    def _bare(self) -> Event:
        """Llama 3 style: the reply is JSON call objects (optionally separated by `;`), or plain text."""
        text, at = self._text, self._pos
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text) or text[at] != "{":
            return Idle()
        try:
            value, end = _JSON.raw_decode(text, at)
        except json.JSONDecodeError:
            return Start()  # the object is still being written
        self._pos = end
        return self._call(value) or Idle()

    def pending(self) -> Call | None:
        """The call that was still being written when generation stopped (the last ``feed`` returned ``Start``),
        with its arguments' JSON text so far; None if there is none or its name is not written whole. A reply cut
        off by its token limit reports this as a call, never as the call's markup."""
        at = self._pos
        if self._format.open:
            if not self._text.startswith(self._format.open, at):
                return None
            at += len(self._format.open)
        body = self._text[at:].lstrip(" \t\r\n;")
        found = _NAME.search(body) if body.startswith("{") else None
        try:
            name = json.loads(found.group(1)) if found else None
        except json.JSONDecodeError:  # an escape cut in half
            name = None
        if name is None:
            return None
        args = _ARGS.search(body, found.end())  # (arguments written before the name are not looked for)
        if args is None:
            return Call(name, "")
        try:  # written whole (only what closes the call is missing): as a complete call reports it
            value, _ = _JSON.raw_decode(body, args.end())
            return Call(name, _arguments_text(value))
        except json.JSONDecodeError:
            return Call(name, body[args.end() :].rstrip())

    def _call(self, value: Any) -> Call | None:
        """The call a parsed JSON value describes, if it is one; the family's args key is preferred."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        key = next((k for k in (self._format.args_key, *_ARGS_KEYS) if k in value), None)
        return Call(value["name"], _arguments_text(value[key] if key else {}))


def _arguments_text(args: Any) -> str:
    """A call's arguments as the OpenAI API carries them: JSON text (a string a model wrote is kept as written)."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
