"""Best-of-N sampling over one shared prefix: prefill once, fork N children, keep the most likely candidate.

pie run examples/best_of_n.py -- --prompt "Name a colour." --n 4 --temperature 0.8 --top-p 0.95 --max-tokens 16

The prompt is flushed once; ``fork()`` gives each child the prefix's committed pages for free (copy-on-write).
Each child samples on its own (``--seed S`` switches to reproducible ``multinomial`` draws, seed S + i for child i)
while an ``Entropy`` probe rides along on every step. Candidates are then scored by their mean log-probability
under the model (temperature 1): one pass per candidate on a fresh fork, with a ``Logprob`` probe on every row.
"""

import asyncio

from inferlet import Context, Entropy, Logprob, Model, Sampler, runtime


async def score(parent: Context, tokens: list[int]) -> list[float]:
    """Log-probability of each of ``tokens`` as the reply to ``parent``'s prompt, read in one forward pass."""
    if not tokens:
        return []
    with parent.fork() as scorer:  # shares the prefix; the pass runs only the cue and the candidate
        lead = scorer.cue().buffer()
        fwd = scorer.forward()
        fwd.input(lead + tokens[:-1])
        handles = [fwd.probe(len(lead) - 1 + i, Logprob(t)) for i, t in enumerate(tokens)]
        out = await fwd.execute()
        return [out.logprobs(h)[0] for h in handles]


async def sample(child: Context, sampler: Sampler, max_tokens: int) -> tuple[list[int], list[float]]:
    """Drive one child's Generator step by step, reading the per-step entropy probe."""
    g = child.generate(sampler, max_tokens=max_tokens)
    h = g.probe_each_step(0, Entropy())
    tokens, entropies = [], []
    async for step in g:
        out = await step.execute()
        tokens += out.tokens
        entropies.append(out.entropy(h))
    return tokens, entropies


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    n, max_tokens = int(input.get("n", 4)), int(input.get("max_tokens", 16))
    temperature, top_p = float(input.get("temperature", 0.8)), float(input.get("top_p", 0.95))
    seed = input.get("seed")
    tokenizer = model.tokenizer()
    with Context(model) as parent:
        parent.system(input.get("system", "You are a helpful assistant.")).user(input.get("prompt", "Name a colour."))
        await parent.flush()  # the shared prefix: prefilled once, its full pages committed
        prefix_len = parent.seq_len
        children = [parent.fork() for _ in range(n)]
        samplers = [
            Sampler.top_p(temperature, top_p) if seed is None else Sampler.multinomial(temperature, int(seed) + i)
            for i in range(n)
        ]
        try:  # the children decode concurrently, so their steps share batches on the replica
            runs = await asyncio.gather(*(sample(c, s, max_tokens) for c, s in zip(children, samplers, strict=True)))
        finally:
            for child in children:
                child.release()
        scores = await asyncio.gather(*(score(parent, tokens) for tokens, _ in runs))
    candidates = [
        {
            "text": tokenizer.decode(tokens),
            "tokens": tokens,
            "sum_logprob": sum(logprobs),
            "mean_logprob": sum(logprobs) / len(logprobs) if logprobs else None,  # None: an empty reply
            "mean_entropy": sum(entropies) / len(entropies),
        }
        for (tokens, entropies), logprobs in zip(runs, scores, strict=True)
    ]
    best = max(range(n), key=lambda i: (candidates[i]["mean_logprob"] is not None, candidates[i]["mean_logprob"] or 0))
    return {"prefix_len": prefix_len, "candidates": candidates, "best": best, "text": candidates[best]["text"]}
