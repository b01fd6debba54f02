"""The example inferlets in examples/, run as `pie run` runs them, checked against transformers where it applies."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch
from inferlet import Context
from pie_cluster.hosts.run import load_program
from support.paths import EXAMPLES
from support.sdk_host import each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend

STOPS = [2, 0]  # <|im_end|>, <|endoftext|>


def example(name: str):
    return load_program(EXAMPLES / f"{name}.py")


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
    for k, (turn, reply) in enumerate(zip(turns, replies, strict=True)):
        messages.append({"role": "user", "content": turn})
        # HF's rendering of the conversation so far, earlier replies as assistant messages: spliced in as the token
        # ids the model produced (a random model's bytes need not survive decode + re-encode)
        prompt = render(tok, messages, [r["tokens"] for r in replies[:k]])
        assert reply["tokens"] == hf_greedy_ids(model, prompt, 10), turn
        assert reply["seq_len"] + reply["pending"] == len(prompt) + len(reply["tokens"]), "cache = the conversation"
        messages.append({"role": "assistant", "content": f"<<reply {k}>>"})
    assert sum(sent) == replies[-1]["seq_len"], "every cached token went through the model exactly once"


def test_best_of_n_shares_the_prefix_scores_right_and_releases_children(served, hf, monkeypatch):
    tok, model = hf
    system, n = "You are a helpful assistant. " * 8, 4
    stats, fork = [], Context.fork

    def watched_fork(self):  # page-store counters around every fork the example makes
        stats.append(ray.get(served.replica.leader.engine_stats.remote()))
        return fork(self)

    monkeypatch.setattr(Context, "fork", watched_fork)
    got = served.run(example("best_of_n"), {"system": system, "prompt": "Name a colour.", "n": n, "max_tokens": 6})
    candidates = got["candidates"]
    assert len(candidates) == n and 0 <= got["best"] < n
    means = [c["mean_logprob"] for c in candidates]
    assert means[got["best"]] == max(m for m in means if m is not None), "the best has the highest mean logprob"
    assert len({tuple(c["tokens"]) for c in candidates}) > 1, "children sample independently"
    # forks 0..n-1 are the children, made back to back right after the prefix was flushed: the committed prefix
    # pages are shared (their count stays put); each fork copies at most the one partly filled page
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}],
        add_generation_prompt=True,
    )["input_ids"]
    cue = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert got["prefix_len"] == len(prompt) - len(cue)
    assert stats[0].committed >= got["prefix_len"] // 16 >= 2
    assert all(s.committed == stats[0].committed for s in stats[:n])
    assert all(b.working - a.working <= 1 for a, b in zip(stats[: n - 1], stats[1:n], strict=True))
    # the Logprob scores equal transformers' log-softmax over the same tokens
    for c in candidates:
        ids = torch.tensor([prompt + c["tokens"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], -1)
        picked = torch.tensor(c["tokens"], dtype=torch.long)  # (an empty reply: no tokens, a sum of 0)
        expected = logp[torch.arange(len(picked)), picked].sum().item()
        assert c["sum_logprob"] == pytest.approx(expected, abs=1e-3)
    after = served.stats()
    assert after.working == 0 and after.contexts == 0, "every child, scorer and the parent released"


def test_snapshot_prefix_is_per_user_and_answers_like_a_fresh_prefill(served):
    main, name = example("snapshot_prefix"), f"handbook-{uuid.uuid4().hex[:8]}"
    question = {"question": "How big is a page?", "max_tokens": 8}
    assert "no snapshot named" in served.run(main, {"mode": "use", "name": name, **question})
    saved = served.run(main, {"mode": "save", "name": name}, user="alice")
    assert saved["seq_len"] > 3 * 16
    try:
        used = served.run(main, {"mode": "use", "name": name, **question}, user="alice")  # another inferlet run
        again = served.run(main, {"mode": "use", "name": name, **question}, user="alice")  # the snapshot stays
        other = served.run(main, {"mode": "use", "name": name, **question}, user="bob")
        fresh = served.run(main, {"mode": "fresh", **question}, user="alice")
    finally:
        served.run(main, {"mode": "delete", "name": name}, user="alice")
    assert used["seq_len"] == saved["seq_len"] == fresh["seq_len"]
    assert used["answer"] == again["answer"] == fresh["answer"] and used["answer"]
    assert isinstance(other, str) and "no snapshot named" in other, "snapshots are per user"
    assert "no snapshot named" in served.run(main, {"mode": "use", "name": name, **question}, user="alice")
    stats = served.stats()
    assert stats.working == 0 and stats.contexts == 0


async def plain_greedy(input: dict) -> list[int]:
    from inferlet import Model, Sampler

    with Context(Model.load("default")) as ctx:
        ctx.system("You are a helpful assistant.").user(input["prompt"])
        return await ctx.generate(Sampler.argmax(), max_tokens=input["n"]).collect_tokens()


def test_watermark_biases_toward_green_and_is_greedy_without_delta(served):
    main, args = example("watermark"), {"prompt": "Write about rivers.", "max_tokens": 24}
    marked = served.run(main, {**args, "delta": 5.0})
    plain = served.run(main, {**args, "delta": 0.0})
    assert marked["accepted"] == len(marked["tokens"]) == 24
    assert plain["accepted"] == len(plain["tokens"]) == 24
    assert marked["green_fraction"] >= 0.9
    assert plain["green_fraction"] < 0.8 and marked["tokens"] != plain["tokens"]
    assert plain["tokens"] == served.run(plain_greedy, {"prompt": args["prompt"], "n": 24}), "delta 0 is argmax"


def test_sliding_window_equals_hf_with_a_4d_window_mask(served, hf):
    tok, model = hf
    main, text = example("sliding_window"), "The river runs to the sea and the sea"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    wide = served.run(main, {"prompt": text, "window": 64, "max_tokens": 8})
    narrow = served.run(main, {"prompt": text, "window": 3, "max_tokens": 8})
    assert wide["prompt_tokens"] == narrow["prompt_tokens"] == ids
    assert wide["tokens"] == hf_greedy_ids(model, ids, 8, stops=[]), "a window over everything is plain causal"
    assert narrow["tokens"] == hf_greedy_ids(model, ids, 8, stops=[], window=3)
    assert narrow["tokens"] != wide["tokens"]
    assert narrow["seq_len"] == len(ids) + 7
    stats = served.stats()
    assert stats.working == 0 and stats.contexts == 0


def render(tok, messages: list[dict], replies: list[list[int]]) -> list[int]:
    """HF's ``apply_chat_template(messages, add_generation_prompt=True)`` ids, reply k's ids put at ``<<reply k>>``."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = []
    for k, reply in enumerate(replies):
        head, text = text.split(f"<<reply {k}>>")
        ids += tok(head, add_special_tokens=False)["input_ids"] + reply
    return ids + tok(text, add_special_tokens=False)["input_ids"]


def record_forwarded_tokens(monkeypatch) -> list[int]:
    """Patch ``Forward`` to log how many input tokens each pass that ran took (a chained pass has no tokens of its
    own: each of its steps runs on the token the step before sampled, and its reply lists one token per step)."""
    from inferlet import Forward

    sent, finish = [], Forward.finish

    def logged(self, answer):
        out = finish(self, answer)
        sent.append(len(self.input_tokens) or len(out.walk))
        return out

    monkeypatch.setattr(Forward, "finish", logged)
    return sent
