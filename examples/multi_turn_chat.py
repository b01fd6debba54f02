"""Multi-turn chat on one live KV cache: each turn appends only its own tokens, nothing is prefilled twice.

pie run examples/multi_turn_chat.py -- --turns '["Hi!", "Why?", "Thanks."]' --max-tokens 24

After a reply, ``seal()`` closes the assistant turn (the stop token itself is never cached), then the next user
turn is appended. ``seq_len`` (tokens in the KV cache) after each turn shows the cache only ever grows by the new
turn: the earlier conversation is never run again.
"""

import json

from inferlet import Context, Model, Sampler, runtime

DEFAULT_TURNS = ["Hello! What is a KV cache?", "Why is it paged?", "Summarise that in five words."]


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    turns = input.get("turns", DEFAULT_TURNS)
    turns = json.loads(turns) if isinstance(turns, str) else list(turns)
    max_tokens = int(input.get("max_tokens", 24))
    tokenizer = model.tokenizer()
    replies = []
    with Context(model) as ctx:
        ctx.system(input.get("system", "You are a helpful assistant."))
        for i, text in enumerate(turns):
            if i:
                ctx.seal()  # close the previous assistant turn exactly as the chat template renders it
            ctx.user(text)
            tokens = await ctx.generate(Sampler.argmax(), max_tokens=max_tokens).collect_tokens()
            replies.append(
                {
                    "reply": tokenizer.decode(tokens),
                    "tokens": tokens,
                    "seq_len": ctx.seq_len,  # in the KV cache now
                    "pending": len(ctx.buffer()),  # the last token when max_tokens cut the reply (not run yet)
                }
            )
    return {"turns": turns, "replies": replies}
