"""Serving one turn of OpenAI's Responses API, where the conversation so far is a live KV context.

A stored response keeps its conversation as a snapshot (``snapshot_name``): the prompt and the output, the
assistant turn closed. A continuation (``previous_response_id``) opens that snapshot, on whichever replica it runs
(the cluster's directory recomputes it from its token lineage where the pages are not), and appends only the
new input items, so only they are prefilled; a continuation whose instructions or tools differ from the stored
header renders the whole history instead. The turn itself is the chat route's code (``inferlet.completions``): the
same rendering, sampler, JSON and tool-call constraints and call parsing, streaming ``Piece`` messages while text
is generated.

The closing tokens of the turn (the last sampled token and the template's turn end) are not run before the reply
leaves: the report hands them back as ``pending`` and the next turn prefills them with its input, in one pass.

A turn asked to ``park`` does not end: it sends its report as a ``Parked`` message and waits on its session with
the context live, so the conversation's next turn (the ingress sends it here) costs no launch, no snapshot to open
and none to save, only its new input's prefill; the ingress tells it to save the snapshot when the conversation
idles. Its context is an ordinary one meanwhile, priced by the market and suspended under memory pressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from inferlet import completions, session
from inferlet.context import Context
from inferlet.model import Model
from inferlet.openai_schema import ChatCompletionRequest, Choice
from inferlet.responses_schema import (
    DISCARD,
    SAVE,
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    Parked,
    Turn,
    TurnReport,
    TurnUsage,
    snapshot_name,
)


async def _opened(model: Model, turn: Turn) -> tuple[Context, list[int], ChatCompletionRequest]:
    """The context to generate on, the tokens to feed it first, and the chat request serving the turn."""
    request = turn.request
    continued = turn.continued
    if continued is None:
        chat = request.as_chat([*turn.history, *request.items], {})
        return await Context.create(model, request.cache_salt or ""), completions.chat_prompt(model, chat), chat
    ctx = await asyncio.to_thread(Context.open, model, continued.snapshot)  # off the event loop: see serve
    if ctx is None:
        raise LookupError(f"the conversation of previous_response_id {request.previous_response_id} is gone")
    chat, tokens = _new_input(model, turn)
    return ctx, continued.pending + tokens, chat


def _new_input(model: Model, turn: Turn) -> tuple[ChatCompletionRequest, list[int]]:
    """A continuation's chat request, and the tokens of its new items and the cue (what follows the stored
    conversation's closing tokens)."""
    request, call_names = turn.request, dict(turn.continued.call_names)
    chat = request.as_chat(request.items, call_names)
    new_turns = chat.messages[1:] if request.instructions else chat.messages  # the instructions are in the KV
    return chat, completions.chat_turns(model, new_turns, call_names) + model.instruct.cue()


def _output(choice: Choice) -> list[OutputItem]:
    """The choice as output items: its text as one assistant message (if any, or if there is nothing else), then
    its tool calls. Cut off by the token limit, the last item is what was cut: ``incomplete``."""
    cut = choice.finish_reason == "length"
    items: list[OutputItem] = []
    if choice.text or not choice.tool_calls:
        content = [OutputText(text=choice.text)]
        status = "incomplete" if cut and not choice.tool_calls else "completed"
        items.append(MessageItem(role="assistant", content=content, id=f"msg_{uuid.uuid4().hex}", status=status))
    for k, call in enumerate(choice.tool_calls, 1):
        status = "incomplete" if cut and k == len(choice.tool_calls) else "completed"
        items.append(
            FunctionCallItem(
                id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.name, arguments=call.arguments, status=status
            )
        )
    return items


async def _save(ctx: Context, name: str) -> None:
    """Save the conversation and end the context, moving its pages into the snapshot, in a thread: a blocking call
    would hold every other turn this process serves for the replica's answer. Cancelled meanwhile (the turn was
    aborted), it lets the save finish and deletes it, so that nothing outlives the turn."""
    saving = asyncio.ensure_future(asyncio.to_thread(ctx.save_and_release, name))
    try:
        await asyncio.shield(saving)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await saving
            Context.delete(ctx.model, name)
        raise


async def serve(input: dict) -> dict | None:
    """The built-in Responses handler: one turn, generated on the continued (or a fresh) context, saved when the
    request stores it; or, parked, every turn of the conversation sent here until it idles."""
    turn = Turn.model_validate(input)
    model = Model.load(turn.request.model)
    ctx, tokens, chat = await _opened(model, turn)
    try:
        while True:
            report = await _generate(model, turn, ctx, tokens, chat)
            if not (turn.park and turn.request.store):
                if turn.request.store:
                    await _save(ctx, snapshot_name(turn.response_id))
                return report.model_dump(mode="json", exclude_none=True)
            session.send(Parked(parked=report).model_dump_json(exclude_none=True))
            word = await session.receive()
            if word == SAVE:
                await _save(ctx, snapshot_name(turn.response_id))
            if word in (SAVE, DISCARD):
                return None
            turn = Turn.model_validate_json(word)
            chat, tokens = _new_input(model, turn)  # the closing tokens are still in the context's buffer
    finally:
        await ctx.release_async()


async def _generate(model: Model, turn: Turn, ctx: Context, tokens: list[int], chat) -> TurnReport:
    """One turn on ``ctx``: its output, usage and (stored) the closing tokens, left buffered in ``ctx``."""
    request = turn.request
    cached, fed = ctx.seq_len, len(ctx.buffer()) + len(tokens)
    choice = await completions.run_choice(model, chat, ctx, 0, tokens, keep=True)
    pending: list[int] = []
    if request.store:
        ctx.seal()
        pending = ctx.buffer()
    usage = TurnUsage(input_tokens=cached + fed, cached_tokens=cached, output_tokens=choice.completion_tokens)
    return TurnReport(output=_output(choice), usage=usage, incomplete=choice.finish_reason == "length", pending=pending)
