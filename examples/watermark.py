"""A green-list watermark (Kirchenbauer et al.) by stepping the Generator by hand.

pie run examples/watermark.py -- --prompt "Write about rivers." --delta 4.0 --gamma 0.5 --max-tokens 32

Each step drops the auto sampler, reads the raw logits, adds ``delta`` to the "green" half of the vocabulary (a
keyed hash of the previous token decides which ids are green), picks the argmax and hands it back with
``g.accept``. A detector that knows the key counts green tokens: far more than ``gamma`` of them means a watermark.
"""

from array import array

from inferlet import Context, Logits, Model, Sampler, runtime

MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def green_list(key: int, prev: int, gamma: float):
    """The test "is this id green?" seeded by the previous token: a ``gamma`` share of the vocabulary is green."""
    seed, bound = _mix(key ^ prev), int(gamma * 2**64)
    return lambda token: _mix((seed + token) & MASK64) < bound


def pick(logits: array, key: int, prev: int, gamma: float, delta: float) -> int:
    """Argmax of the logits after adding ``delta`` to every green id."""
    green = green_list(key, prev, gamma)
    best, best_score = 0, float("-inf")
    for token, value in enumerate(logits):
        if delta and green(token):
            value += delta
        if value > best_score:
            best, best_score = token, value
    return best


def green_fraction(tokens: list[int], first_prev: int, key: int, gamma: float) -> float:
    """The detector: the share of tokens that are green given the token before each."""
    prevs = [first_prev, *tokens[:-1]]
    return sum(green_list(key, p, gamma)(t) for p, t in zip(prevs, tokens, strict=True)) / max(1, len(tokens))


async def main(input: dict) -> dict:
    model = Model.load(runtime.models()[0])
    delta, gamma = float(input.get("delta", 4.0)), float(input.get("gamma", 0.5))
    key, max_tokens = int(input.get("key", 15485863)), int(input.get("max_tokens", 32))
    with Context(model) as ctx:
        ctx.system("You are a helpful assistant.").user(input.get("prompt", "Write about rivers."))
        g = ctx.generate(Sampler.argmax(), max_tokens=max_tokens)
        first_prev = prev = ctx.buffer()[-1]  # the last prompt token seeds the first green list
        tokens: list[int] = []
        async for step in g:
            step.clear_sampler()
            h = step.probe(0, Logits())
            out = await step.execute()
            logits = array("f")
            logits.frombytes(out.logits(h))  # native-endian float32, one per vocabulary id
            chosen = pick(logits, key, prev, gamma, delta)
            tokens += g.accept([chosen])  # a stop token ends the turn (and is not kept)
            prev = chosen
        return {
            "text": model.tokenizer().decode(tokens),
            "tokens": tokens,
            "accepted": g.tokens_generated,
            "green_fraction": green_fraction(tokens, first_prev, key, gamma),
        }
