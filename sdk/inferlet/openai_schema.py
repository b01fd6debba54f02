"""The OpenAI request and the report that answers it: one definition for the ingress route that validates the
request and the program that serves it.

It lives in the SDK because both ends import it: the cluster's routes already import the SDK (whose dependency
arrows allow no ``pie_cluster`` import), and it is the input contract of every program behind the API, built-in or
uploaded, while the replica's wire package (``pie_workers.wire``) has nothing to do with it. The route validates the
body, hands ``request.as_input()`` to the program, and the program reads it back with ``read_request``; the program
answers with a ``Report`` and streams ``Piece`` messages, which the route validates with the same models.

Fields follow what vLLM's server accepts for these routes. A field we do not implement is refused, naming it
(``extra="forbid"``, here and in every report), never silently ignored; the few that are accepted but have no effect
say so below. Besides OpenAI's fields: ``top_k``, ``min_p``, ``ignore_eos``, ``cache_salt`` (as vLLM: only requests
of the same user naming the same salt share cached prompt pages) and ``inferlet``, the id of an uploaded program to
serve the request instead of the built-in one.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pie_workers.wire.messages import MAX_CACHE_SALT
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 8
DEFAULT_CHAT_MAX_TOKENS = 1024
"""A chat request that names no limit ends at the model's turn end or after this many tokens."""


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

    @property
    def text(self) -> str:
        """The content as one string (a list of parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


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
    """What both routes share, and the readings a serving program uses whichever route it serves."""

    api: ClassVar[str]
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
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_CACHE_SALT, description="prompt pages are shared only under the same salt"
    )

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (only 0, which has no effect)")
        return value

    @model_validator(mode="after")
    def _one_filter_family(self) -> Self:
        if self.min_p > 0 and (self.top_p < 1 or self.top_k > 0):
            raise ValueError("min_p cannot be combined with top_p or top_k")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def as_input(self) -> dict:
        """The program's input: the fields the client set, as JSON (``read_request`` reads it back)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def uses_tools(self) -> bool:
        return False

    @property
    def forced_tools(self) -> list[dict]:
        """The tool specs one of which the output must call (none: the output is free)."""
        return []


class ChatCompletionRequest(_Sampling):
    api: ClassVar[str] = "chat"
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

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS

    @property
    def alternatives(self) -> int | None:
        """How many alternatives to report with each token's log-probability; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def with_alternatives(self, top: int | None) -> Self:
        return self.model_copy(update={"logprobs": top is not None, "top_logprobs": top})

    @property
    def tool_specs(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[dict]:
        if not self.tools or self.tool_choice in (None, "auto", "none"):
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [s for s in self.tool_specs if s["function"]["name"] == self.tool_choice.function.name]
        return self.tool_specs


class CompletionRequest(_Sampling):
    api: ClassVar[str] = "completions"
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
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"{len(self.prompts)} prompts x n={self.n} is over the {MAX_CHOICES} choices a request may ask"
            )
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def token_limit(self) -> int:
        return self.max_tokens

    @property
    def alternatives(self) -> int | None:
        return self.logprobs

    def with_alternatives(self, top: int | None) -> Self:
        return self.model_copy(update={"logprobs": top})


def read_request(input: dict) -> ChatCompletionRequest | CompletionRequest:
    """The request a route validated, from the program's input (a chat request is the one with ``messages``)."""
    return (ChatCompletionRequest if "messages" in input else CompletionRequest).model_validate(input)


# -- what the serving program reports --------------------------------------------------------------------------------


class TokenLogprob(_Strict):
    """One generated token's log-probability and the ``top`` most likely alternatives as (token, logprob)."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = Field(default_factory=list)


class ReportedCall(_Strict):
    id: str
    name: str
    arguments: str


class Choice(_Strict):
    """One generated choice: its text (or tool calls), why it ended, and per-token logprobs when asked.
    ``completion_tokens`` counts into the report's usage and is not reported with the choice."""

    index: int = Field(ge=0)
    text: str = ""
    finish_reason: str = "stop"
    tool_calls: list[ReportedCall] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    completion_tokens: int = Field(0, ge=0, exclude=True)


class Usage(_Strict):
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)


class Piece(_Strict):
    """A streamed piece of one choice (a ``session.send`` of the serving program)."""

    index: int = Field(ge=0)
    text: str = ""
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class Report(_Strict):
    """The serving program's return value."""

    choices: list[Choice]
    usage: Usage = Field(default_factory=Usage)

    def as_output(self) -> dict:
        return self.model_dump(mode="json")
