"""Every ``Output`` accessor with every kind of handle, after one real forward pass on the tiny model.

The reference types each accessor ``X | None`` (``tokens_at``: a list): an accessor given a handle that did not ask
for what it reads (a sampler's handle to ``logits``, a ``Logits`` probe's to ``entropy``) answers None (or []), and
the matching handle gets the real value."""

from __future__ import annotations

import pytest
from inferlet import Context, Distribution, Entropy, Logits, Logprob, Logprobs, Model, Sampler
from support.sdk_host import each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend

VOCAB = 4096
ACCESSORS = ("token", "tokens_at", "distribution", "logits", "logprobs", "entropy")
MATCHING = {  # handle name -> the accessor that reads it
    "sampler": "token",
    "logits": "logits",
    "distribution": "distribution",
    "logprob": "logprobs",
    "logprobs": "logprobs",
    "entropy": "entropy",
}


@pytest.fixture(scope="module")
def answers(served):
    """accessor -> handle name -> a description of what it returned."""

    async def main(input):
        with Context(Model.load("default")) as ctx:
            fwd = ctx.forward().input([5, 6, 7, 8])
            handles = {
                "sampler": fwd.sample([3], Sampler.argmax()),
                "logits": fwd.probe(3, Logits()),
                "distribution": fwd.probe(3, Distribution(1.0, 5)),
                "logprob": fwd.probe(3, Logprob(11)),
                "logprobs": fwd.probe(3, Logprobs([11, 12, 13])),
                "entropy": fwd.probe(3, Entropy()),
            }
            out = await fwd.execute()
            return {
                accessor: {name: describe(getattr(out, accessor)(h)) for name, h in handles.items()}
                for accessor in ACCESSORS
            }

    def describe(value):
        if value is None or value == []:
            return "none"
        if isinstance(value, bytes):
            return f"bytes:{len(value)}"
        if isinstance(value, tuple):
            return f"distribution:{len(value[0])}"
        if isinstance(value, list):
            return f"list:{len(value)}"
        return type(value).__name__

    return served.run(main)


@pytest.mark.parametrize("accessor", ACCESSORS)
@pytest.mark.parametrize("handle", list(MATCHING))
def test_each_accessor_answers_its_own_handle_and_none_for_the_others(answers, accessor, handle):
    got = answers[accessor][handle]
    if MATCHING[handle] == accessor or (accessor == "tokens_at" and handle == "sampler"):
        expected = {
            "token": "int",
            "tokens_at": "list:1",
            "logits": f"bytes:{VOCAB * 4}",
            "distribution": "distribution:5",
            "logprobs": "list:3" if handle == "logprobs" else "list:1",
            "entropy": "float",
        }[accessor]
        assert got == expected
    else:
        assert got == "none"
