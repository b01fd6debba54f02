"""Serving OpenAI-style chat and completion requests from an inferlet.

The cluster's ``/v1/chat/completions`` and ``/v1/completions`` routes run each request as an inferlet whose input is
the validated request (``read_request`` reads it; the models are ``inferlet.openai_schema``'s). ``serve`` is the
built-in behaviour: render the prompt, prefill it once, fork a context per choice (they share the prompt's pages),
generate the choices side by side with the request's sampler and constraints, and report them. A program named by a
request's ``inferlet`` field gets the same input and answers in the same shape, reusing these parts for whatever it
does differently.

What an inferlet behind the API reports (the ingress turns it into OpenAI's objects):

* while streaming, ``session.send`` of ``Piece`` messages (``{"index": i, "text": delta, "logprobs": [...]}``);
* its return value, a ``Report`` as ``report.as_output()`` (when streaming, a choice's text was already sent and is
  not repeated).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from inferlet import chat, session, tools
from inferlet.constraints import AnyJson, GrammarConstraint, JsonSchema
from inferlet.context import Context
from inferlet.generator import Generator
from inferlet.model import Model
from inferlet.openai_schema import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    Message,
    Piece,
    Report,
    ReportedCall,
    TokenLogprob,
    Usage,
    read_request,
)
from inferlet.sampler import Sampler
from inferlet.tokenizer import TextStream

Request = ChatCompletionRequest | CompletionRequest
"""Either route's request, as ``read_request`` gives it."""


# -- prompts -----------------------------------------------------------------------------------------------------


def chat_prompt(model: Model, request: ChatCompletionRequest) -> list[int]:
    """The conversation's tokens up to the opened assistant turn: system turns, the tools (when in use), then the
    other turns in order (``chat_turns``)."""
    instruct = model.instruct
    tokens: list[int] = []
    for message in request.messages:
        if message.role in ("system", "developer"):
            tokens += instruct.system(message.text)
    if request.uses_tools:
        tokens += tools.equip_prefix(model, request.tool_specs)
    turns = [m for m in request.messages if m.role not in ("system", "developer")]
    return tokens + chat_turns(model, turns, {}) + instruct.cue()


def chat_turns(model: Model, messages: list[Message], call_names: dict[str, str]) -> list[int]:
    """Turns in order, as appended to a conversation: an assistant's ``tool_calls`` are written in the family's
    call syntax and a tool result is answered under the name of the call it answers (``call_names`` holds the
    calls of earlier turns by id, and gains these). A system turn here is written where it stands."""
    instruct = model.instruct
    tokens: list[int] = []
    for message in messages:
        role, content = message.role, message.text
        if role in ("system", "developer"):
            tokens += instruct.system(content)
        elif role == "user":
            tokens += instruct.user(content)
        elif role == "assistant":
            calls = message.tool_calls or []
            call_names |= {call.id: call.function.name for call in calls}
            written = [tools.call_text(model, c.function.name, c.function.arguments) for c in calls]
            tokens += instruct.assistant("\n".join([content, *written]) if content else "\n".join(written))
        elif role == "tool":
            name = call_names.get(message.tool_call_id or "", message.name or "tool")
            tokens += instruct.answer(name, content)
    return tokens


# -- sampling and constraints ------------------------------------------------------------------------------------


def sampler(request: Request, choice: int) -> Sampler:
    """The request's sampler for one choice. With a ``seed``, choice i draws from ``seed`` and i, so the same
    request gives the same choices and the choices differ from each other."""
    t = request.temperature
    if t == 0:
        chosen = Sampler.argmax()
    elif request.top_k > 0 and request.top_p < 1:
        chosen = Sampler.top_k_top_p(t, request.top_k, request.top_p)
    elif request.top_k > 0:
        chosen = Sampler.top_k(t, request.top_k)
    elif request.top_p < 1:
        chosen = Sampler.top_p(t, request.top_p)
    elif request.min_p > 0:
        chosen = Sampler.min_p(t, request.min_p)
    else:
        chosen = Sampler.multinomial(t)
    if request.seed is not None:
        seed = ((request.seed & 0xFFFF_FFFF) << 20 | choice) + 1  # 0 would mean fresh randomness
        chosen = Sampler(dataclasses.replace(chosen.slot, seed=seed))
    return chosen if request.alternatives is None else chosen.with_logprobs(request.alternatives)


def constraint(model: Model, request: Request) -> Any:
    """What the output must match: a forced tool call in the family's syntax, or the response format's JSON."""
    if forced := request.forced_tools:
        return GrammarConstraint(tools.native_matcher(model, forced))
    fmt = request.response_format if isinstance(request, ChatCompletionRequest) else None
    if fmt is not None and fmt.type == "json_object":
        return AnyJson()
    if fmt is not None and fmt.type == "json_schema":
        return JsonSchema(fmt.json_schema.schema_)
    return None


# -- generation --------------------------------------------------------------------------------------------------


class StopText:
    """Cuts generated text at the first stop string, holding back a tail that may be the start of one, so a
    stop string is never sent, even in part."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that can be released now, and whether a stop string ended the choice."""
        self._held += text
        hits = [at for at in (self._held.find(s) for s in self._stops) if at >= 0]
        if hits:
            released, self._held = self._held[: min(hits)], ""
            return released, True
        keep = max((k for s in self._stops for k in range(len(s) - 1, 0, -1) if self._held.endswith(s[:k])), default=0)
        cut = len(self._held) - keep
        released, self._held = self._held[:cut], self._held[cut:]
        return released, False

    def rest(self) -> str:
        held, self._held = self._held, ""
        return held


class _ChoiceRun:
    """Generates one choice on its own context, streaming what it may as it goes."""

    def __init__(self, model: Model, request: Request, index: int, ctx: Context, echo: str) -> None:
        self.model, self.request, self.ctx = model, request, ctx
        self.choice = Choice(index=index, finish_reason="length")
        self._text = TextStream(model.tokenizer())
        self._special = model.tokenizer().special_ids
        self._stop = StopText(request.stops)
        self._hold_all = request.uses_tools  # a tool call's text is parsed at the end, never streamed as content
        self._tokens: list[int] = []
        if echo:
            self._release(echo, [])

    async def run(self, first_input: list[int], keep: bool = False) -> Choice:
        """Generate the choice; its context is released after, unless ``keep`` (the caller saves it)."""
        request, ctx = self.request, self.ctx
        ctx.append(first_input)
        stops = [] if request.ignore_eos else chat.stop_tokens(self.model)
        gen = Generator(ctx, sampler(request, self.choice.index), max_tokens=request.token_limit, auto_flush=False)
        gen.stop(stops)
        if (c := constraint(self.model, request)) is not None:
            gen.constrain(c)
        if request.alternatives is None:
            await gen.drain(self._take)
        else:  # every step's sampler output is needed, so no chained passes
            async for step in gen:
                if self._take(await step.execute()):
                    break
        if self.choice.finish_reason != "stop" and gen.tokens_generated < request.token_limit:
            self.choice.finish_reason = "stop"  # a stop token (or a finished grammar) ended it
        self.choice.completion_tokens = gen.tokens_generated
        if not keep:
            await ctx.release_async()
        self._release(self._stop.rest(), [])
        if request.uses_tools:
            self._parse_tool_calls()
        return self.choice

    def _take(self, out) -> bool:
        """One step's tokens: decode, cut at a stop string, stream; True ends the choice."""
        tokens = out.tokens
        self._tokens += tokens
        logprobs = []  # a stepped generation (the only kind with logprobs) yields one token per step
        if self.request.alternatives is not None and tokens:
            logprobs.append(self._logprob_entry(tokens[-1], out.sampled_logprobs(out.auto_sampler)))
        released, stopped = self._stop.feed(self._text.push(t for t in tokens if t not in self._special))
        self._release(released, logprobs)
        if stopped:
            self.choice.finish_reason = "stop"
        return stopped

    def _logprob_entry(self, token: int, report) -> TokenLogprob:
        decode = self.model.tokenizer().decode
        top = [(decode([i]), lp) for i, lp in zip(report.top_ids, report.top_logprobs, strict=True)] if report else []
        return TokenLogprob(token=decode([token]), logprob=report.logprob if report else 0.0, top=top)

    def _release(self, text: str, logprobs: list[TokenLogprob]) -> None:
        self.choice.text += text
        self.choice.logprobs += logprobs
        if self.request.stream and not self._hold_all and (text or logprobs):
            session.send(Piece(index=self.choice.index, text=text, logprobs=logprobs).model_dump_json())

    def _parse_tool_calls(self) -> None:
        """Split the finished text into content and calls (the family's decoder finds them). A call the token
        limit cut off is the last call, with its arguments so far, and the choice ends with "length"; its markup
        is never content."""
        decoder = tools.Decoder(self.model)
        event = decoder.feed(self._tokens)
        while isinstance(event, tools.Call):
            self._add_call(event)
            event = decoder.feed([]) if self.request.parallel_tool_calls else None
        cut = self.choice.finish_reason == "length" and isinstance(event, tools.Start)
        if cut and (partial := decoder.pending()) is not None:
            self._add_call(partial)
        if self.choice.tool_calls or cut:  # cut before its name was whole: no call, and no markup as text either
            self.choice.text = _without_calls(self.model, self.choice.text)
        elif self.choice.finish_reason == "length":  # cut inside a call's opening tag
            self.choice.text = _without_opening(self.model, self.choice.text)
        if self.choice.tool_calls and not cut:
            self.choice.finish_reason = "tool_calls"

    def _add_call(self, call: tools.Call) -> None:
        reported = ReportedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=call.name, arguments=call.args)
        self.choice.tool_calls.append(reported)


def _without_calls(model: Model, text: str) -> str:
    """The text outside the tool calls (the Llama 3 syntax is a bare call: nothing is left)."""
    fmt = model.instruct.tool_call_format
    if not fmt.open:
        return ""
    kept, at = [], 0
    while (start := text.find(fmt.open, at)) >= 0:
        kept.append(text[at:start])
        end = text.find(fmt.close, start)
        at = len(text) if end < 0 else end + len(fmt.close)
    kept.append(text[at:])
    return "".join(kept).strip()


def _without_opening(model: Model, text: str) -> str:
    """``text`` without the start of a call's opening tag that it ends with."""
    opening = model.instruct.tool_call_format.open
    cut = next((k for k in range(len(opening) - 1, 0, -1) if text.endswith(opening[:k])), 0)
    return text[: len(text) - cut].rstrip() if cut else text


def prompts(model: Model, request: Request) -> list[tuple[list[int], str]]:
    """Each prompt's tokens and the text its choices echo: the conversation for chat, else each prompt string."""
    if isinstance(request, ChatCompletionRequest):
        return [(chat_prompt(model, request), "")]
    encode = model.tokenizer().encode
    return [(encode(p), p if request.echo else "") for p in request.prompts]


async def run_choice(
    model: Model, request: Request, ctx: Context, index: int, first_input: list[int], keep: bool = False
) -> Choice:
    """Generate one choice on ``ctx`` (fed ``first_input`` first), streaming it if the request streams; ``keep``
    leaves ``ctx`` live afterwards (else it is released)."""
    return await _ChoiceRun(model, request, index, ctx, "").run(first_input, keep)


async def serve(input: dict) -> dict:
    """The built-in request handler: every prompt's ``n`` choices, generated concurrently."""
    request = read_request(input)
    model = Model.load(request.model)
    rendered = prompts(model, request)
    runs = []
    for p, (tokens, echo) in enumerate(rendered):
        runs += await _forked(model, request, tokens, echo, first_index=p * request.n)
    choices = await asyncio.gather(*runs)
    prompt_tokens = sum(len(tokens) for tokens, _ in rendered)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(c.completion_tokens for c in choices))
    return Report(choices=choices, usage=usage).as_output()


async def _forked(model: Model, request: Request, tokens: list[int], echo: str, first_index: int) -> list:
    """The prompt's choices as coroutines. With several, all but the prompt's last token is prefilled once and
    each choice forks from it (sharing those pages); the last token runs with each choice's first step."""
    if not tokens:
        raise ValueError("the prompt is empty: there is nothing to generate from")
    base = await Context.create(model, request.cache_salt or "")
    if request.n == 1:
        return [_ChoiceRun(model, request, first_index, base, echo).run(tokens)]
    base.append(tokens[:-1])
    await base.flush()
    forks = [await base.fork_async() for _ in range(request.n)]
    await base.release_async()
    return [_ChoiceRun(model, request, first_index + i, fork, echo).run(tokens[-1:]) for i, fork in enumerate(forks)]
