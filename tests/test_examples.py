"""The example inferlets in examples/, run as `pie run` runs them, checked against transformers where it applies."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import ray
import torch
from inferlet import Context
from pie_cluster.host import load_program
from transformers import AutoModelForCausalLM, AutoTokenizer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STOPS = [2, 0]  # <|im_end|>, <|endoftext|>


def example(name: str):
    return load_program(EXAMPLES / f"{name}.py")


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama), AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def hf_greedy_ids(model, ids: list[int], n: int, stops=STOPS, window: int | None = None) -> list[int]:
    """Greedy continuation of raw ids, recomputed in full each step; ``window`` applies a sliding-window 4-D mask."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            mask = None
            if window is not None:
                i, j = torch.arange(len(ids))[:, None], torch.arange(len(ids))[None]
                mask = ((j <= i) & (j > i - window))[None, None]
            token = int(model(torch.tensor([ids]), attention_mask=mask).logits[0, -1].argmax())
            if token in stops:
                break
            out.append(token)
            ids.append(token)
    return out


def test_text_completion_runs(served):
    assert isinstance(served.run(example("text_completion"), {"prompt": "Hi", "max_tokens": 4}), str)


def test_multi_turn_chat_equals_hf_on_the_rendered_conversation(served, hf, monkeypatch):
    tok, model = hf
    turns = ["Hello! What is a KV cache?", "Why is it paged?", "Summarise that in five words."]
    system = "You are a helpful assistant."
    sent = record_forwarded_tokens(monkeypatch)
    got = served.run(example("multi_turn_chat"), {"turns": turns, "max_tokens": 10, "system": system})
    replies = got["replies"]
    assert len(replies) == 3
    messages = [{"role": "system", "content": system}]
    for k, (turn, reply) in enumerate(zip(turns, replies)):
        messages.append({"role": "user", "content": turn})
        # HF's rendering of the conversation so far, earlier replies as assistant messages: spliced in as the token
        # ids the model produced (a random model's bytes need not survive decode + re-encode)
        prompt = render(tok, messages, [r["tokens"] for r in replies[:k]])
        assert reply["tokens"] == hf_greedy_ids(model, prompt, 10), turn
        assert reply["seq_len"] + reply["pending"] == len(prompt) + len(reply["tokens"]), "cache = the conversation"
        messages.append({"role": "assistant", "content": f"<<reply {k}>>"})
    assert sum(sent) == replies[-1]["seq_len"], "every cached token went through the model exactly once"


def render(tok, messages: list[dict], replies: list[list[int]]) -> list[int]:
    """Token ids of ``apply_chat_template(messages, add_generation_prompt=True)`` with reply k's ids at ``<<reply k>>``."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = []
    for k, reply in enumerate(replies):
        head, text = text.split(f"<<reply {k}>>")
        ids += tok(head, add_special_tokens=False)["input_ids"] + reply
    return ids + tok(text, add_special_tokens=False)["input_ids"]


def record_forwarded_tokens(monkeypatch) -> list[int]:
    """Patch ``Forward.execute`` to log how many input tokens each pass sends."""
    from inferlet import Forward

    sent, execute = [], Forward.execute

    async def logged(self):
        sent.append(len(self._tokens))
        return await execute(self)

    monkeypatch.setattr(Forward, "execute", logged)
    return sent


def test_zz_peek(served):
    import json

    for name, inp in [
        ("multi_turn_chat", {"max_tokens": 10}),
        ("best_of_n", {"seed": 7, "max_tokens": 8, "temperature": 1.0}),
        ("best_of_n", {}),
        ("watermark", {"delta": 5.0, "max_tokens": 24}),
        ("watermark", {"delta": 0.0, "max_tokens": 24}),
        ("sliding_window", {"window": 3}),
        ("sliding_window", {"window": 100}),
        ("snapshot_prefix", {"mode": "use", "name": "x"}),
        ("snapshot_prefix", {"mode": "save", "name": "x"}),
        ("snapshot_prefix", {"mode": "use", "name": "x"}),
        ("snapshot_prefix", {"mode": "fresh"}),
        ("snapshot_prefix", {"mode": "delete", "name": "x"}),
    ]:
        print(name, inp, json.dumps(served.run(example(name), inp))[:600])
    print(served.stats())
