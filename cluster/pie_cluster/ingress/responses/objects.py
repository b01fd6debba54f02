"""Responses-API objects and stream events, built from what the serving program reports (``inferlet.responses_schema``'s
``TurnReport``, and the chat route's ``Piece`` messages while text streams).

A streamed response is Server-Sent Events, ``event: <type>`` and ``data: <event>``, every event numbered by
``sequence_number``: ``response.created``, ``response.in_progress``, then per output item ``output_item.added``,
its content (``content_part.added``, ``output_text.delta``..., ``output_text.done``, ``content_part.done``; or
``function_call_arguments.delta`` and ``.done``), ``output_item.done``, and last ``response.completed`` (or
``response.incomplete``, ``response.failed``) carrying the whole response. Text streams as it is generated; a reply
with tool calls is parsed at its end, so its items go out then.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from inferlet.openai_schema import Piece
from inferlet.responses_schema import FunctionCallItem, MessageItem, OutputText, ResponsesRequest, TurnReport
from pydantic import ValidationError

from pie_cluster.ingress.openai.checks import OpenAIError


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def parse_turn(value: str) -> TurnReport:
    """The return event's value; anything else is the serving program's mistake, answered as 502."""
    try:
        return TurnReport.model_validate_json(value)
    except ValidationError as e:
        raise OpenAIError(502, f"the inferlet returned no response ({e.errors()[0]['msg']})") from None


def response_object(request: ResponsesRequest, response_id: str, created_at: float, **fields: Any) -> dict:
    """The ``response`` object for ``request``: in progress, or with ``fields`` (status, output, usage, error...)."""
    text = request.text.model_dump(mode="json", by_alias=True, exclude_none=True) if request.text else None
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "model": request.model,
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "previous_response_id": request.previous_response_id,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": [t.model_dump(mode="json", exclude_none=True) for t in request.tools or []],
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": text or {"format": {"type": "text"}},
        "truncation": request.truncation or "disabled",
        "metadata": request.metadata or {},
        "store": request.store,
        "background": request.background,
        "user": request.user,
    }
    return body | fields


def finished(request: ResponsesRequest, response_id: str, created_at: float, report: TurnReport) -> dict:
    """The finished response object for the program's report."""
    usage = report.usage
    return response_object(
        request,
        response_id,
        created_at,
        status="incomplete" if report.incomplete else "completed",
        completed_at=time.time(),
        incomplete_details={"reason": "max_output_tokens"} if report.incomplete else None,
        output=[item.model_dump(mode="json", exclude_none=True) for item in report.output],
        usage={
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.input_tokens + usage.output_tokens,
        },
    )


def failed(request: ResponsesRequest, response_id: str, created_at: float, error: OpenAIError) -> dict:
    """The response object of a turn that did not finish."""
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    return response_object(
        request, response_id, created_at, status="failed", error={"code": code, "message": error.message}
    )


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump(mode="json")


@dataclass
class ResponseStream:
    """One streamed response: the events sent so far, and the message item whose text is streaming."""

    request: ResponsesRequest
    response_id: str
    created_at: float
    sequence: int = 0
    message_id: str | None = None
    streamed: str = ""

    def opening(self) -> list[str]:
        head = response_object(self.request, self.response_id, self.created_at)
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def piece(self, message: str) -> list[str]:
        """Events for one streamed piece of text (a message that is not a ``Piece`` adds nothing)."""
        try:
            piece = Piece.model_validate_json(message)
        except ValidationError:
            return []
        lines = self._open_message() if self.message_id is None else []
        self.streamed += piece.text
        return lines + [self._text_delta(piece.text)] if piece.text else lines

    def adopt(self, report: TurnReport) -> None:
        """Give the reported message the id its streamed events already carry (before the body is built)."""
        for item in report.output:
            if isinstance(item, MessageItem) and self.message_id is not None:
                item.id = self.message_id

    def ending(self, report: TurnReport, body: dict) -> list[str]:
        """Every item's remaining events, then the terminal event with the whole response ``body``."""
        lines: list[str] = []
        for index, item in enumerate(report.output):
            if isinstance(item, MessageItem):
                lines += self._close_message(item, index)
            elif isinstance(item, FunctionCallItem):
                lines += self._call(item, index)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return lines + [self._event(kind, response=body)]

    def failure(self, body: dict) -> list[str]:
        return [self._event("response.failed", response=body)]

    # -- items ---------------------------------------------------------------------------------------------------

    def _open_message(self, item_id: str | None = None) -> list[str]:
        self.message_id = item_id or f"msg_{uuid.uuid4().hex}"
        item = {"type": "message", "id": self.message_id, "role": "assistant", "status": "in_progress", "content": []}
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **where, part=_text_part("")),
        ]

    def _text_delta(self, text: str) -> str:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return self._event("response.output_text.delta", **where, delta=text, logprobs=[])

    def _close_message(self, item: MessageItem, index: int) -> list[str]:
        """The message's text not streamed yet, then its closing events, under the reported item's id."""
        lines = self._open_message(item.id) if self.message_id is None else []
        text = item.text
        rest = text[len(self.streamed) :] if text.startswith(self.streamed) else ""
        if rest:
            lines.append(self._text_delta(rest))
        where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        done = item.model_dump(mode="json", exclude_none=True)
        return lines + [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_text_part(text)),
            self._event("response.output_item.done", output_index=index, item=done),
        ]

    def _call(self, item: FunctionCallItem, index: int) -> list[str]:
        added = item.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump(mode="json")
        where = {"item_id": item.id, "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", **where, delta=item.arguments),
            self._event("response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments),
            self._event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")),
        ]

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _text_part(text: str) -> dict:
    return OutputText(text=text).model_dump(mode="json", exclude_none=True)
