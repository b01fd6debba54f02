"""Beam search on raw forward passes: one context per beam, expanded with a ``Distribution`` probe, forked.

pie run examples/beam_search.py -- --prompt "Name a colour." --width 3 --steps 6

Each step runs every live beam's newest token through the model in one pass (the beams share batches on the
replica) with a ``Distribution(1.0, width)`` probe on it: the ``width`` likeliest next tokens and their
probabilities. The ``width`` best continuations overall survive; each is a ``fork()`` of its parent, which shares the
parent's pages (copy-on-write), and the parents are released. Scores are summed log-probabilities, so with
``--width 1`` this is greedy decoding. Beams run a fixed number of steps (no stop tokens), to keep them comparable.
"""

import asyncio
import math
from dataclasses import dataclass

from inferlet import Context, Distribution, Model, runtime


@dataclass
class Beam:
    ctx: Context
    pending: list[int]  # tokens the model has not run yet (the prompt, then the token that made this beam)
    tokens: list[int]  # generated so far
    score: float  # sum of the generated tokens' log-probabilities


async def expand(beam: Beam, width: int) -> list[tuple[int, float]]:
    """Run the beam's pending tokens; the ``width`` likeliest next tokens with their log-probabilities."""
    fwd = beam.ctx.forward()
    fwd.input(beam.pending)
    handle = fwd.probe(len(beam.pending) - 1, Distribution(1.0, width))
    ids, probs = (await fwd.execute()).distribution(handle)
    return [(token, math.log(p)) for token, p in zip(ids, probs, strict=True) if p > 0]


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    width, steps = int(input.get("width", 3)), int(input.get("steps", 6))
    root = Context(model)
    root.system(input.get("system", "You are a helpful assistant.")).user(input.get("prompt", "Name a colour."))
    prompt = root.cue().buffer()
    beams = [Beam(root, prompt, [], 0.0)]
    try:
        for _ in range(steps):
            expansions = await asyncio.gather(*(expand(b, width) for b in beams))
            ranked = sorted(
                ((b.score + lp, b, t) for b, options in zip(beams, expansions, strict=True) for t, lp in options),
                key=lambda c: -c[0],
            )[:width]
            survivors = [Beam(b.ctx.fork(), [t], b.tokens + [t], score) for score, b, t in ranked]
            for b in beams:
                b.ctx.release()
            beams = survivors
        decode = model.tokenizer().decode
        found = [{"tokens": b.tokens, "score": b.score, "text": decode(b.tokens)} for b in beams]
        return {"prompt": prompt, "beams": found, "best": found[0]}
    finally:
        for b in beams:
            b.ctx.release()
