"""Tree of thought: branch a line of reasoning with forks, let the model judge each branch, grow the best one.

pie run examples/tree_of_thought.py -- --problem "Plan a three-step route to the library." --branches 3 --levels 2

The problem is prefilled once. At each level the current best node is forked ``--branches`` times; each branch
writes its next thought (seeded sampling, so branches differ and runs repeat). A judge then scores every branch
without disturbing it: on a fork of the branch it asks "Is this step sound? Answer yes or no." and reads the
log-probabilities of "yes" and "no" at the answer's first position with ``Logprob`` probes, in one forward pass.
The branch with the highest yes-minus-no margin is kept and grown at the next level; the others are released.
"""

import asyncio

from inferlet import Context, Logprob, Model, Sampler, runtime

JUDGE_QUESTION = "Is this step sound? Answer yes or no."


async def think(branch: Context, seed: int, max_tokens: int) -> list[int]:
    branch.user("Next step:").cue()
    tokens = await branch.generate(Sampler.multinomial(1.0, seed), max_tokens=max_tokens).collect_tokens()
    branch.seal()
    return tokens


async def judge(branch: Context, yes: int, no: int) -> float:
    """log P(yes) - log P(no) for the judge's answer, read on a fork so the branch itself is left as it was."""
    with branch.fork() as juror:
        lead = juror.user(JUDGE_QUESTION).cue().buffer()
        fwd = juror.forward()
        fwd.input(lead)
        yes_handle, no_handle = fwd.probe(len(lead) - 1, Logprob(yes)), fwd.probe(len(lead) - 1, Logprob(no))
        out = await fwd.execute()
        return out.logprobs(yes_handle)[0] - out.logprobs(no_handle)[0]


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    tokenizer = model.tokenizer()
    branches, levels = int(input.get("branches", 3)), int(input.get("levels", 2))
    max_tokens, seed = int(input.get("max_tokens", 8)), int(input.get("seed", 0))
    yes, no = tokenizer.encode("yes")[0], tokenizer.encode("no")[0]
    tree = []
    best = Context(model)
    best.system("Think step by step.").user(input.get("problem", "Plan a three-step route to the library."))
    await best.flush()
    try:
        for level in range(levels):
            children = [best.fork() for _ in range(branches)]
            thoughts = await asyncio.gather(
                *(think(c, seed + level * branches + i, max_tokens) for i, c in enumerate(children))
            )
            scores = await asyncio.gather(*(judge(c, yes, no) for c in children))
            chosen = max(range(branches), key=lambda i: scores[i])
            tree.append(
                {
                    "branches": [
                        {"thought": tokenizer.decode(t), "tokens": t, "score": s}
                        for t, s in zip(thoughts, scores, strict=True)
                    ],
                    "chosen": chosen,
                }
            )
            best.release()
            for i, child in enumerate(children):
                if i != chosen:
                    child.release()
            best = children[chosen]
        return {"tree": tree, "answer": " / ".join(level["branches"][level["chosen"]]["thought"] for level in tree)}
    finally:
        best.release()
