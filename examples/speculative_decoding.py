"""Speculative decoding with a speculator written in the inferlet: prompt lookup.

pie run examples/speculative_decoding.py -- --text "the cat sat on the mat and the cat sat on the" --max-tokens 32

``PromptLookup`` drafts by copying: it finds the latest earlier place where the last few tokens occurred (in the
prompt or in what was generated since) and proposes the tokens that followed there. The Generator sends the drafts
with each step; the replica checks them in the same forward pass and keeps the run the sampler agrees with, plus
its own next token. So the output is exactly greedy decoding's, in fewer passes when the text repeats itself
(summaries, code edits, quoting). The result reports the passes and how many drafted tokens were accepted.
"""

from inferlet import Context, Model, Sampler, runtime


class PromptLookup:
    """The ``inferlet.spec.Speculator`` protocol: ``draft``, ``accept``, ``rollback``, ``reset``."""

    def __init__(self, ctx: Context, prompt: list[int], ngram: int = 2, k: int = 4):
        self.ctx, self.ngram, self.k = ctx, ngram, k
        self.history = list(prompt)  # every token the context holds or is about to run
        self.drafted = self.accepted = 0

    def draft(self) -> tuple[list[int], list[int]]:
        tail = self.history[-self.ngram :]
        for start in range(len(self.history) - self.ngram - 1, -1, -1):  # latest earlier occurrence first
            if self.history[start : start + self.ngram] == tail:
                tokens = self.history[start + self.ngram : start + self.ngram + self.k]
                first = self.ctx.seq_len + len(self.ctx.buffer())  # right after the step's input
                self.drafted += len(tokens)
                return tokens, list(range(first, first + len(tokens)))
        return [], []

    def accept(self, tokens: list[int]) -> None:
        self.history += tokens
        self.accepted += max(0, len(tokens) - 1)  # all but the model's own token were drafts

    def rollback(self, n: int) -> None:
        pass  # rejected drafts never entered the history

    def reset(self) -> None:
        self.history.clear()


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    max_tokens = int(input.get("max_tokens", 32))
    with Context(model) as ctx:
        ctx.user(input.get("text", "the cat sat on the mat and the cat sat on the mat and the cat sat on the"))
        ctx.cue()
        speculator = PromptLookup(ctx, ctx.buffer(), int(input.get("ngram", 2)), int(input.get("drafts", 4)))
        generator = ctx.generate(Sampler.argmax(), max_tokens=max_tokens, speculator=speculator)
        tokens, passes = [], 0
        async for step in generator:
            tokens += (await step.execute()).tokens
            passes += 1
    return {
        "tokens": tokens,
        "text": model.tokenizer().decode(tokens),
        "passes": passes,
        "drafted": speculator.drafted,
        "accepted": speculator.accepted,
    }
