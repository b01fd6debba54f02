"""The OpenAI-compatible requests the ingress accepts, checked where they enter, and what the serving inferlet gets.

Fields follow what vLLM's server accepts for these routes. A field we do not implement is refused with 400 naming
it (``extra="forbid"``), never silently ignored; the few that are accepted but have no effect say so below. Besides
OpenAI's fields: ``top_k``, ``min_p``, ``ignore_eos`` (as vLLM) and ``inferlet``, the id of an uploaded program to
serve the request instead of the built-in one.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 8
DEFAULT_CHAT_MAX_TOKENS = 1024
"""A chat request that names no limit ends at the model's turn end or after this many tokens."""


class OpenAIError(Exception):
    """An error to answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "rate_limit_error" if self.status == 429 else "server_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class ToolCall(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # forced calls are always grammar-constrained; auto ones never are


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # usage per chunk is not built: true is refused


class _Sampling(_Strict):
    """What both routes share."""

    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: no top-k filter")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=256, description="accepted, has no effect")
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    inferlet: str | None = Field(None, min_length=1, max_length=1024, description="program id serving the request")

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (only 0, which has no effect)")
        return value

    @model_validator(mode="after")
    def _one_filter_family(self) -> _Sampling:
        if self.min_p > 0 and (self.top_p < 1 or self.top_k > 0):
            raise ValueError("min_p cannot be combined with top_p or top_k")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling_input(self) -> dict:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "model": self.model,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "min_p": self.min_p,
            "seed": self.seed,
            "n": self.n,
            "stop": stops,
            "stream": self.stream,
            "ignore_eos": self.ignore_eos,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call per choice (the first)")

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError('tool_choice "required" needs tools')
        return self

    def inferlet_input(self) -> dict:
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        choice = self.tool_choice or ("auto" if tools else "none")
        if isinstance(choice, NamedToolChoice):
            choice = {"name": choice.function.name}
        return {
            "api": "chat",
            **self.sampling_input(),
            "messages": [m.model_dump(exclude_none=True) for m in self.messages],
            "max_tokens": self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "response_format": _format_input(self.response_format),
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def grammar_checks(self) -> list[tuple[str, dict]]:
        """(param, schema) pairs the grammar compiler must accept before anything is launched."""
        checks = []
        if self.response_format is not None and self.response_format.json_schema is not None:
            checks.append(("response_format", self.response_format.json_schema.schema_))
        if self.tool_choice not in (None, "none", "auto"):
            checks += [("tools", t.function.parameters) for t in self.tools or []]
        return checks


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: None = Field(None, description="not supported: must be absent or null")

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[str]) -> str | list[str]:
        if not all(prompt if isinstance(prompt, list) else [prompt]):
            raise ValueError("a prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _choices_bounded(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (the prompt's log-probabilities are not computed)")
        prompts = len(self.prompt) if isinstance(self.prompt, list) else 1
        if prompts * self.n > MAX_CHOICES:
            raise ValueError(f"{prompts} prompts x n={self.n} is over the {MAX_CHOICES} choices a request may ask")
        return self

    def inferlet_input(self) -> dict:
        return {
            "api": "completions",
            **self.sampling_input(),
            "prompts": [self.prompt] if isinstance(self.prompt, str) else list(self.prompt),
            "max_tokens": self.max_tokens,
            "logprobs": self.logprobs,
            "echo": self.echo,
        }

    def grammar_checks(self) -> list[tuple[str, dict]]:
        return []


def _format_input(response_format: ResponseFormat | None) -> dict | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "schema": response_format.json_schema.schema_}


def check_grammars(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse, with 400 naming the field, a JSON schema the grammar compiler cannot build (before a launch)."""
    checks = request.grammar_checks()
    if checks:
        import xgrammar  # only here: it imports torch, which the ingress otherwise never needs
    for param, schema in checks:
        try:
            xgrammar.Grammar.from_json_schema(json.dumps(schema))
        except Exception as e:  # xgrammar raises RuntimeError (and others) with the compiler's reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OpenAIError(400, f"{param}: invalid JSON schema: {reason}", param=param) from None
