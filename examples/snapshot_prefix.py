"""A long system prompt prefilled once and saved as a named snapshot, then reused by later runs.

Against a running cluster (`pie start`): each `pie run` has a replica of its own, which ends with the run.

pie submit examples/snapshot_prefix.py -- --mode save --name handbook
pie submit examples/snapshot_prefix.py -- --mode use --name handbook --question "How big is a page?"
pie submit examples/snapshot_prefix.py -- --mode fresh --question "How big is a page?"   (no snapshot: to compare)
pie submit examples/snapshot_prefix.py -- --mode delete --name handbook

Snapshots are per user and model and live until deleted or taken, beyond the inferlet and the replica that saved
them (another replica recomputes one from its token lineage). ``Context.open`` gives a copy-on-write copy, so any
number of runs can start from the same prefilled prefix without prefilling it again.
"""

from inferlet import Context, Model, Sampler, runtime

HANDBOOK = [
    "The KV cache is split into fixed-size pages.",
    "Full pages are committed and shared between contexts by prefix.",
    "A fork copies only the partly filled last page.",
    "Snapshots keep a context's pages alive under a name, per user.",
    "Generation stops on the chat template's end-of-turn tokens.",
    "Each inferlet is an async Python function running next to the engine.",
]


def system_prompt(repeat: int) -> str:
    return "You answer questions about this handbook.\n" + "\n".join(HANDBOOK * repeat)


async def answer(ctx: Context, question: str, max_tokens: int) -> str:
    ctx.user(question)
    return await ctx.generate(Sampler.argmax(), max_tokens=max_tokens).collect_text()


async def main(input: dict) -> dict | str:
    model = Model.load(runtime.models()[0])
    mode, name = input.get("mode", "use"), str(input.get("name", "handbook"))
    question = input.get("question", "How big is a page?")
    max_tokens, repeat = int(input.get("max_tokens", 16)), int(input.get("repeat", 3))
    if mode == "save":
        with Context(model) as ctx:
            await ctx.system(system_prompt(repeat)).flush()  # only what is in the KV cache is saved
            ctx.save(name)
            return {"saved": name, "seq_len": ctx.seq_len}
    if mode == "use":
        ctx = Context.open(model, name)
        if ctx is None:
            return f"error: no snapshot named {name!r} for this user; run with --mode save --name {name} first"
        with ctx:
            seq_len = ctx.seq_len
            return {"answer": await answer(ctx, question, max_tokens), "seq_len": seq_len}
    if mode == "fresh":
        with Context(model) as ctx:
            await ctx.system(system_prompt(repeat)).flush()
            seq_len = ctx.seq_len
            return {"answer": await answer(ctx, question, max_tokens), "seq_len": seq_len}
    if mode == "delete":
        Context.delete(model, name)
        return {"deleted": name}
    raise ValueError(f"unknown --mode {mode!r}: use save, use, fresh or delete")
