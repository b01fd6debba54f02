"""Sliding-window attention from the inferlet side: raw forward passes with a custom attention mask.

pie run examples/sliding_window.py -- --prompt "The river runs to the sea and the sea" --window 4 --max-tokens 8

Every token, prompt and generated alike, attends only to the last ``window`` tokens (itself included). The prompt
runs as one ``Forward`` with one mask row per token; then each new token is decoded greedily by its own
``Forward``. A mask row is a BRLE over the KV slots ``[0, seq_len + inputs)``: a run of skipped slots, then a run of
attended ones. (KV written under a custom mask is never shared with other contexts by prefix.)
"""

from inferlet import Context, Model, Sampler, runtime


def window_row(slot: int, window: int) -> list[int]:
    """BRLE row for the token in KV slot ``slot``: skip the slots before the window, attend the rest up to itself."""
    start = max(0, slot + 1 - window)
    return [start, slot + 1 - start]


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    window, max_tokens = int(input.get("window", 4)), int(input.get("max_tokens", 8))
    if window < 1:
        raise ValueError("--window must be at least 1")
    tokenizer = model.tokenizer()
    prompt = tokenizer.encode(input.get("prompt", "The river runs to the sea and the sea"))
    with Context(model) as ctx:
        pending, tokens = prompt, []
        while len(tokens) < max_tokens:
            fwd = ctx.forward()
            fwd.input(pending)
            fwd.attention_mask([window_row(ctx.seq_len + i, window) for i in range(len(pending))])
            h = fwd.sample([len(pending) - 1], Sampler.argmax())
            token = (await fwd.execute()).token(h)
            tokens.append(token)
            pending = [token]
        return {"prompt_tokens": prompt, "tokens": tokens, "text": tokenizer.decode(tokens), "seq_len": ctx.seq_len}
