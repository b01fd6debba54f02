"""OpenAI's Responses API request and what the program behind it reads and reports: one definition for the ingress
route that validates a request and the built-in program (``inferlet.responses``) that serves it.

It sits in the SDK beside ``openai_schema`` for the same reason: both ends import it. A Responses request is
served as a chat request (``as_chat``), so rendering, sampling, tool calls and JSON constraints are the chat
route's own code. Items the client sends back (a response's ``message`` and ``function_call`` outputs) are the same
models the program reports, so an agent that re-sends its history validates without changes. A field we do not
implement is refused by name (``extra="forbid"``); the few accepted without effect say so. Besides OpenAI's
fields: ``ignore_eos`` and ``cache_salt``, as on the chat route.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pie_workers.wire.messages import MAX_CACHE_SALT
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

from inferlet.openai_schema import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionSpec,
    JsonSchemaFormat,
    Message,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)

RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- items: what a conversation is made of, in requests and in responses ---------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list, description="always empty here")
    logprobs: list[dict[str, Any]] | None = Field(None, description="accepted back from a client, never produced")


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(value: Any) -> str:
    """A message may leave out its ``type`` (OpenAI's "easy" input message)."""
    return (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]
OutputItem = MessageItem | FunctionCallItem


def chat_messages(items: list, call_names: dict[str, str]) -> list[Message]:
    """Items as chat messages: a run of function calls becomes one assistant message with ``tool_calls``, a call's
    output a ``tool`` message answering its call id. ``call_names`` gains every call's name by id."""
    messages: list[Message] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(Message(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallItem):
            call_names[item.call_id] = item.name
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None and not last.text:
                last.tool_calls.append(call)
            else:
                messages.append(Message(role="assistant", tool_calls=[call]))
        else:
            name = call_names.get(item.call_id, "tool")
            messages.append(Message(role="tool", content=item.text, tool_call_id=item.call_id, name=name))
    return messages


# -- the request -------------------------------------------------------------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls are always grammar-constrained; auto ones never are


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["medium"] | None = Field(None, description="only the default")


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1, max_length=256)
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, pattern=RESPONSE_ID_PATTERN)
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    background: bool = Field(False, description="answer at once, in progress; the turn finishes on its own")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256, description="accepted, has no effect")
    truncation: Literal["disabled", "auto"] | None = Field(None, description="nothing is ever truncated")
    include: list[str] | None = None
    ignore_eos: bool = Field(False, description="as vLLM's chat routes: generate max_output_tokens whatever comes")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_CACHE_SALT, description="prompt pages are shared only under the same salt"
    )

    @field_validator("background")
    @classmethod
    def _stored_unstreamed(cls, background: bool, info: ValidationInfo) -> bool:
        if background and not info.data.get("store", True):
            raise ValueError("background responses must be stored (store: true): they are read back with GET")
        if background and info.data.get("stream"):
            raise ValueError("background responses cannot be streamed here: read them back with GET")
        return background

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, include: list[str] | None) -> list[str] | None:
        if include:
            raise ValueError(f"include {include} is not supported (no extra output is produced)")
        return include

    @property
    def items(self) -> list:
        """The input as items (a string is one user message)."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def as_chat(self, items: list, call_names: dict[str, str]) -> ChatCompletionRequest:
        """The chat request that serves this one over ``items`` (the input, or a whole history before it)."""
        messages = ([Message(role="system", content=self.instructions)] if self.instructions else []) + chat_messages(
            items, call_names
        )
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        fields["ignore_eos"] = self.ignore_eos
        for key, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if value is not None:
                fields[key] = value
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tools:
            fields["tools"] = [Tool(type="function", function=_function_spec(t)) for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(name=self.tool_choice.name))
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format.type != "text":
            fields["response_format"] = _response_format(self.text.format)
        return ChatCompletionRequest(**fields)

    def header(self) -> str:
        """What the conversation's context begins with (model, instructions, the tools when in use), as a digest: a
        continuation whose header is the previous response's appends to its context, any other re-renders it."""
        uses_tools = bool(self.tools) and self.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] if uses_tools else []
        key = json.dumps([self.model, self.instructions or "", tools], sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()


def _function_spec(tool: FunctionTool) -> FunctionSpec:
    spec = {"name": tool.name, "description": tool.description, "strict": tool.strict}
    if tool.parameters is not None:
        spec["parameters"] = tool.parameters
    return FunctionSpec(**spec)


def _response_format(fmt: TextFormat) -> ResponseFormat:
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.name is None or fmt.schema_ is None:
        raise ValueError("text.format of type json_schema needs a name and a schema")
    schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, description=fmt.description, strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


# -- the program's input and report ------------------------------------------------------------------------------


class Continued(_Strict):
    """The stored conversation a continuation appends to: its snapshot, the tokens that close its last turn and are
    not in the snapshot's KV yet, and the names of the calls its outputs may answer."""

    snapshot: str
    pending: list[int] = Field(default_factory=list)
    call_names: dict[str, str] = Field(default_factory=dict)


class Turn(_Strict):
    """The program's input: the request, the response's id, and either the context to continue or the whole
    history to render before the input (a continuation whose header changed, or whose context was never saved).
    ``park``: after the turn, keep the context live and wait for the conversation's next turn (``Parked``)."""

    request: ResponsesRequest
    response_id: str = Field(pattern=RESPONSE_ID_PATTERN)
    continued: Continued | None = None
    history: list[Item] = Field(default_factory=list)
    park: bool = False


def snapshot_name(response_id: str) -> str:
    """The snapshot that keeps a stored response's conversation, per user and model."""
    return f"pie-responses/{response_id}"


class TurnUsage(_Strict):
    input_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0, description="input tokens already in the continued context's KV")
    output_tokens: int = Field(0, ge=0)


class TurnReport(_Strict):
    """The program's return value: the output items, usage, why it stopped, and (stored) the tokens that close
    the turn after what the snapshot holds."""

    output: list[Annotated[OutputItem, Field(discriminator="type")]]
    usage: TurnUsage
    incomplete: bool = False
    pending: list[int] = Field(default_factory=list)


class Parked(_Strict):
    """The message a parked program sends when a turn is done: its report. It then waits on its session for the
    next ``Turn`` of the conversation (only its new input is prefilled: the context is live), or for ``SAVE``
    (the conversation idled: save it as the response's snapshot and end) or ``DISCARD`` (it was deleted: end)."""

    parked: TurnReport


SAVE, DISCARD = "save", "discard"
