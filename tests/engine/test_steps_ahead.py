"""Stepping with ``async for`` on a replica: each plain step has the replica run the next one ahead, and the next
step takes it. Tokens, ``seq_len``, buffer and KV end exactly as with generating one token at a time (which never
asks for a step ahead), whether the loop runs to its end, breaks early, or appends to the context between steps."""

from __future__ import annotations

from inferlet import Context, Model, Sampler
from sdk_host import each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend

PROMPT = "Count the rivers: one blue, two blue, three"


async def one_at_a_time(ctx: Context, n: int, append_after: int | None = None) -> list[int]:
    """The reference: n generations of one token each (a single pass each: no chaining, nothing run ahead)."""
    tokens: list[int] = []
    for i in range(n):
        tokens += await ctx.generate(Sampler.argmax(), max_tokens=1, stop=[], auto_flush=False).collect_tokens()
        if i + 1 == append_after:
            ctx.append([42])
    return tokens


async def stepping(ctx: Context, n: int, append_after: int | None = None, break_after: int | None = None):
    tokens: list[int] = []
    async for step in ctx.generate(Sampler.argmax(), max_tokens=n, stop=[], auto_flush=False):
        tokens += (await step.execute()).tokens
        if len(tokens) == append_after:
            ctx.append([42])
        if len(tokens) == break_after:
            break
    return tokens


async def continuation(ctx: Context) -> list[int]:
    return await ctx.generate(Sampler.argmax(), max_tokens=6, stop=[], auto_flush=False).collect_tokens()


def _compare(served, n: int, **how) -> tuple:
    """Run the reference and stepping on two forks of one prompt; returns both runs' (tokens, seq_len, buffer,
    continuation), the steps run ahead and taken meanwhile, and the replica's pages once the inferlet ended."""

    async def main(input):
        model = Model.load("default")
        with Context(model) as base:
            base.user(PROMPT)
            await base.flush()
            base.append([7])
            plain, ahead = base.fork(), base.fork()
            reference = await one_at_a_time(plain, how.get("break_after") or n, how.get("append_after"))
            before = served.stats()
            got = await stepping(ahead, n, **how)
            after = served.stats()
            counts = after["ahead"] - before["ahead"], after["ahead_taken"] - before["ahead_taken"]
            runs = [(t, c.seq_len, c.buffer(), await continuation(c)) for t, c in ((reference, plain), (got, ahead))]
            return runs, counts

    runs, counts = served.run(main)
    stats = served.stats()
    return runs, counts, (stats["working"], stats["contexts"])


def test_stepping_takes_the_steps_run_ahead(served):
    runs, (ran, taken), pages = _compare(served, 24)
    assert runs[1] == runs[0] and len(runs[1][0]) == 24
    assert ran == taken == 23, "every step but the last ran the next one ahead, and the next step took it"
    assert pages == (0, 0)


def test_breaking_out_of_the_loop_leaves_the_context_as_single_steps_do(served):
    runs, (ran, taken), pages = _compare(served, 24, break_after=5)
    assert runs[1] == runs[0] and len(runs[1][0]) == 5
    assert ran == 5 and taken == 4, "the step run ahead of the break was dropped"
    assert pages == (0, 0), "its page too"


def test_appending_between_steps_drops_the_step_ahead(served):
    runs, (ran, taken), pages = _compare(served, 12, append_after=4)
    assert runs[1] == runs[0] and len(runs[1][0]) == 12
    assert ran == 11 and taken == 10, "the step after the append ran afresh"
    assert pages == (0, 0)
