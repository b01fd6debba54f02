"""The collectors' fast way through a plain generation: chained passes, the next one always in flight.

The collectors (``collect_tokens``, ``collect_text``) hand no step to user code, so when nothing else needs a step's
token before the next step can go — no constraint, no speculation — they let the replica run up to ``CHAIN_STEPS``
steps per pass, each on the token the step before sampled (a *chained* pass, ending at a stop token), and send the
next such pass before the previous one's output is back. The inferlet's round trip then overlaps the replica's
batches instead of adding to them, and the replica's bookkeeping per step is a fraction of a pass's. Tokens, KV,
``seq_len`` and the buffer end exactly as with stepping one by one, also when a collector returns early or is
cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pie_workers.wire.messages import PassReply, decode

from inferlet.forward import Forward, Output, SampleHandle
from inferlet.generation import Generation

CHAIN_STEPS = 16  # steps a collector asks of one chained pass


@dataclass
class _Sent:
    """A pass in flight: its Forward, the auto sampler's handle, the answer to come, and its input."""

    fwd: Forward
    auto: SampleHandle
    reply: asyncio.Future
    fed: list[int] | None  # its input; for a chained pass None until the token it feeds is known here
    steps: int  # steps the replica runs at most (each one input token)
    end: int  # the position after its last step's input


async def drain_chained(gen: Generation, take: Callable[[Output], bool]) -> None:
    """Step ``gen`` until done, handing each step's output to ``take`` (True: stop early)."""
    ctx = gen.ctx
    if gen.is_done:
        return
    if not ctx.buffer():
        gen.done = True
        return
    tokens = ctx.take_buffer()
    try:
        cur: _Sent | None = await _send(gen, tokens, ctx.seq_len)
    except BaseException:
        ctx.requeue(tokens)
        raise
    nxt: _Sent | None = None
    stop_ids = sorted(gen.stop)  # nothing can change them while this runs
    try:
        while cur is not None:
            room = CHAIN_STEPS if gen.max_tokens is None else gen.max_tokens - gen.generated - cur.steps
            if room > 0:
                nxt = await _send(gen, None, cur.end, stop_ids, min(room, CHAIN_STEPS), cur.steps)
            reply = await asyncio.shield(cur.reply)
            steps, cur = _read(gen, cur, reply), None
            for surplus, out in steps:
                if take(out):
                    if nxt is not None:
                        surplus += await _undo(nxt)
                        nxt = None
                    if surplus:
                        await ctx.truncate_async(surplus)
                    return
            if nxt is not None and not gen.done:  # the chained pass feeds the token the buffer now holds
                nxt.fed = ctx.take_buffer()
                cur, nxt = nxt, None
    finally:
        await _unchain(gen, cur, nxt)


async def _send(
    gen: Generation,
    tokens: list[int] | None,
    position: int,
    stop_ids: list[int] | None = None,
    steps: int = 1,
    after: int = 0,
) -> _Sent:
    """Send a plain step: ``tokens`` from ``position`` on, or (None) a pass chained on the previous one, which the
    replica runs for up to ``steps`` steps, each on the token the step before sampled, ending after one that
    samples a token of ``stop_ids`` (and skipping the pass if its first input is one). ``after``: the steps of the
    pass it is chained on, whose tokens it may have to let be undone too."""
    fwd, auto = await gen.step_pass(tokens, position, gen.step_probes)
    if tokens is None:
        reply = fwd.chain(position, stop_ids, steps).send(hold=steps + after)
        return _Sent(fwd, auto, reply, None, steps, position + steps)
    return _Sent(fwd, auto, fwd.send(), tokens, 1, position + len(tokens))


def _read(gen: Generation, sent: _Sent, reply: dict) -> Iterator[tuple[int, Output]]:
    """Fold a sent pass's tokens in one by one, as single steps would, each token moving from the buffer into the
    KV as the next step ran; yields, per token, its Output (the last one carries the pass's slots) and how many
    tokens after it the KV holds already."""
    out = sent.fwd.finish(reply)
    out.auto_sampler = sent.auto
    walk = out.walk or [out.token(sent.auto)]  # a chained pass lists its tokens
    for i, token in enumerate(walk):
        step = out if i == len(walk) - 1 else Output([], auto_sampler=sent.auto)
        if i:
            gen.ctx.take_buffer()
        step.tokens, _ = gen.fold([token])
        yield len(walk) - 1 - i, step


async def _undo(sent: _Sent) -> int:
    """Wait for a chained pass nobody will read; returns how many tokens it wrote to the KV."""
    try:
        reply = await sent.reply
    except Exception:  # it failed, or followed a pass that did: nothing reached the KV
        return 0
    return 0 if reply is None else len(decode(PassReply, reply).walk)  # None: skipped, at a stop token


async def _unchain(gen: Generation, cur: _Sent | None, nxt: _Sent | None) -> None:
    """Leave the context as stepping one by one would have: read a pass whose reply was not read (the collector was
    cancelled or failed while waiting), and undo a chained pass nobody will read (truncating the tokens it wrote).
    Replies are awaited to the end, so the state is known."""
    ctx = gen.ctx
    if cur is not None:
        try:
            for _ in _read(gen, cur, await cur.reply):
                pass
        except Exception:  # nothing of it reached the KV
            ctx.requeue(cur.fed)
    if nxt is None:
        return
    if written := await _undo(nxt):  # the token it fed stays in the buffer, as it never moved from there
        await ctx.truncate_async(written)
