"""OpenAI's response objects, built from what a serving inferlet reports (``inferlet.openai_schema``'s ``Report`` and
``Piece``, the models the program builds them with).

A non-streamed request answers one ``chat.completion`` or ``text_completion`` object. A streamed one answers Server-
Sent Events, each ``data: <chunk>``, ending with ``data: [DONE]``; a chat choice opens with a chunk carrying the
assistant role, and every choice closes with a chunk carrying its ``finish_reason``. Whatever a choice's final text
holds beyond what its pieces streamed (an inferlet that streams nothing, or tool-call text parsed at the end) goes
out just before that closing chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from inferlet.openai_schema import Choice, Piece, Report, ReportedCall, TokenLogprob, Usage
from pydantic import ValidationError

from pie_cluster.ingress.openai.checks import OpenAIError


def parse_report(value: str) -> Report:
    """The return event's value; anything else is the serving program's mistake, answered as 502."""
    try:
        return Report.model_validate_json(value)
    except ValidationError as e:
        first = e.errors()[0]["msg"]
        message = f"the inferlet returned no completion ({e.error_count()} problems: {first})"
        raise OpenAIError(502, message) from None


@dataclass
class Reply:
    """One response under construction: its identity, and per choice what has been streamed so far."""

    api: str  # "chat" or "completions"
    model: str
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    streamed_text: dict[int, str] = field(default_factory=dict)
    streamed_logprobs: dict[int, int] = field(default_factory=dict)

    @property
    def object_id(self) -> str:
        return f"chatcmpl-{self.id}" if self.api == "chat" else f"cmpl-{self.id}"

    # -- whole responses -----------------------------------------------------------------------------------------

    def complete(self, reported: Report) -> dict:
        if self.api == "chat":
            choices = [
                {
                    "index": c.index,
                    "message": _message(c),
                    "logprobs": _chat_logprobs(c.logprobs) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in reported.choices
            ]
        else:
            choices = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": _completion_logprobs(c.logprobs, 0) if c.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in reported.choices
            ]
        return {**self._head(complete=True), "choices": choices, "usage": _usage(reported.usage)}

    # -- streams -------------------------------------------------------------------------------------------------

    def piece(self, message: str) -> list[str]:
        """SSE lines for one streamed piece ``{"index", "text", "logprobs"?}``; a message that is not one (a program
        may send others) adds nothing."""
        try:
            piece = Piece.model_validate_json(message)
        except ValidationError:
            return []
        index, text, logprobs = piece.index, piece.text, piece.logprobs
        lines = self._opening(index)
        offset = len(self.streamed_text.get(index, ""))
        self.streamed_text[index] = self.streamed_text.get(index, "") + text
        self.streamed_logprobs[index] = self.streamed_logprobs.get(index, 0) + len(logprobs)
        return lines + [self._chunk(index, text=text, logprobs=logprobs, offset=offset)]

    def ending(self, reported: Report) -> list[str]:
        """SSE lines closing every choice (the text not streamed yet, tool calls, finish reason), then the usage
        chunk if asked, then ``[DONE]``."""
        lines: list[str] = []
        for c in reported.choices:
            lines += self._opening(c.index)
            streamed = self.streamed_text.get(c.index, "")
            rest = c.text[len(streamed) :] if c.text.startswith(streamed) else ""
            rest_logprobs = c.logprobs[self.streamed_logprobs.get(c.index, 0) :]
            if rest or rest_logprobs:
                lines.append(self._chunk(c.index, text=rest, logprobs=rest_logprobs, offset=len(streamed)))
            if c.tool_calls and self.api == "chat":
                calls = [_tool_call(call, k) for k, call in enumerate(c.tool_calls)]
                lines.append(self._chunk(c.index, tool_calls=calls))
            lines.append(self._chunk(c.index, finish_reason=c.finish_reason))
        if self.include_usage:
            lines.append(_sse({**self._head(), "choices": [], "usage": _usage(reported.usage)}))
        return lines + ["data: [DONE]\n\n"]

    def _opening(self, index: int) -> list[str]:
        if index in self.streamed_text:
            return []
        self.streamed_text[index] = ""
        return [self._chunk(index, role="assistant")] if self.api == "chat" else []

    def _chunk(self, index: int, *, text=None, logprobs=(), offset=0, role=None, tool_calls=None, finish_reason=None):
        choice: dict[str, Any] = {"index": index}
        if self.api == "chat":
            delta: dict[str, Any] = {}
            if role is not None:
                delta.update(role="assistant", content="")
            if text:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
            choice["logprobs"] = _chat_logprobs(logprobs) if logprobs else None
        else:
            choice["text"] = text or ""
            choice["logprobs"] = _completion_logprobs(logprobs, offset) if logprobs else None
        choice["finish_reason"] = finish_reason
        chunk = {**self._head(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def _head(self, complete: bool = False) -> dict:
        kind = ("chat.completion" if complete else "chat.completion.chunk") if self.api == "chat" else "text_completion"
        return {"id": self.object_id, "object": kind, "created": self.created, "model": self.model}


def error_event(message: str, status: int = 500) -> str:
    """The SSE line that reports a failure after the stream has begun (the status line is already sent)."""
    kind = "invalid_request_error" if status == 400 else "server_error"
    return _sse({"error": {"message": message, "type": kind, "param": None, "code": None}}) + "data: [DONE]\n\n"


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _message(choice: Choice) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text or (None if choice.tool_calls else "")}
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls
        ]
    return message


def _tool_call(call: ReportedCall, index: int) -> dict:
    function = {"name": call.name, "arguments": call.arguments}
    return {"index": index, "id": call.id, "type": "function", "function": function}


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _token_bytes(e.token),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)} for t, lp in e.top],
            }
            for e in entries
        ]
    }


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """The completions API's column layout; ``text_offset`` counts characters from the choice's start."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }
