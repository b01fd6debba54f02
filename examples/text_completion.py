"""Text completion: a chat prompt in, the model's reply out.

pie run examples/text_completion.py -- --prompt "Write a haiku about paging" --max-tokens 32
"""

from inferlet import Context, Model, Sampler, runtime


async def main(input: dict) -> str:
    model = Model.load(runtime.models()[0])
    with Context(model) as ctx:
        ctx.system("You are a helpful assistant.")
        ctx.user(input.get("prompt", "Tell me about paged attention."))
        return await ctx.generate(Sampler.argmax(), max_tokens=int(input.get("max_tokens", 32))).collect_text()
