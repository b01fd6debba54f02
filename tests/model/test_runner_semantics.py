"""Runner semantics beyond plain parity: masks, probes, drafts, page copies, and rejection of bad input."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pie_workers import logit_masks
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire import brle
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot, SlotKind
from support.paged import LOGITS, PageAllocator, Seq, greedy_generate, greedy_step, request_for
from transformers import AutoModelForCausalLM

PAGES = 128


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES, backend="torch"))  # vllm: test_vllm_kernels


def prompt_of(n: int, seed: int = 0, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def test_logit_mask_is_respected_by_samplers_and_seen_by_probes(runner):
    allowed = [7, 100, 2000, 4095]
    bits = np.zeros(runner.cfg.vocab_size, dtype=bool)
    bits[allowed] = True
    mask = brle.encode(bits)
    samplers = [
        Slot(SlotKind.MULTINOMIAL, temperature=5.0),
        Slot(SlotKind.TOP_K, temperature=5.0, top_k=50),
        Slot(SlotKind.TOP_P, temperature=5.0, top_p=0.99),
        Slot(SlotKind.MIN_P, temperature=5.0, min_p=0.01),
        Slot.argmax(),
    ]
    seen = set()
    for trial in range(40):
        seq = Seq(prompt_of(9, trial))
        slots = [(8, s) for s in samplers] + [(8, Slot(SlotKind.LOGPROBS, token_ids=(7, 8))), (8, LOGITS)]
        form = brle.pack(mask) if trial % 2 else mask  # packed, as the channel sends it, or the runs
        out = runner.execute(
            ForwardBatch([request_for(seq, PageAllocator(PAGES, trial), 16, slots=slots, logit_mask=form)])
        )[0]
        tokens = [s.token for s in out.slots[: len(samplers)]]
        assert set(tokens) <= set(allowed)
        seen.update(tokens)
        assert out.slots[-2].logprobs[1] == float("-inf")  # token 8 is masked: probes see masked logits
        raw = np.frombuffer(out.slots[-1].logits, np.float32)
        assert np.isneginf(raw[~bits]).all() and np.isfinite(raw[bits]).all()
    assert len(seen) > 1


def test_prefill_without_samplers_fills_kv_for_later_decode(runner):
    prompt = prompt_of(35, 8)
    seq = Seq(list(prompt))
    alloc = PageAllocator(PAGES, 12)
    out = runner.execute(ForwardBatch([request_for(seq, alloc, 16, slots=[])]))[0]
    assert out.error is None and out.slots == []
    seq.kv_len = 34  # re-run the last prompt token on top of the cached prefix
    seq.tokens = prompt
    o = runner.execute(ForwardBatch([request_for(Seq(prompt, pages=seq.pages, kv_len=34), alloc, 16)]))[0]
    assert o.slots[0].token == greedy_generate(runner, prompt, 1, PageAllocator(PAGES, 13))[0]


def test_seeded_multinomial_is_reproducible(runner):
    slot = Slot(SlotKind.MULTINOMIAL, temperature=3.0, seed=1234)
    draws = [
        runner.execute(ForwardBatch([request_for(Seq(prompt_of(5)), PageAllocator(PAGES), 16, slots=[(4, slot)])]))[0]
        .slots[0]
        .token
        for _ in range(5)
    ]
    assert len(set(draws)) == 1
    # ...but the next position draws fresh noise: a seeded generation does not repeat one token forever
    seq = Seq(prompt_of(5))
    alloc = PageAllocator(PAGES, 3)
    tokens = []
    for _ in range(8):
        o = runner.execute(ForwardBatch([request_for(seq, alloc, 16, slots=[(len(seq.pending()) - 1, slot)])]))[0]
        seq.kv_len = len(seq.tokens)
        seq.tokens.append(o.slots[0].token)
        tokens.append(o.slots[0].token)
    assert len(set(tokens)) > 1


@pytest.mark.parametrize("prompt_len", [9, 14])  # 14 + 1 pending + drafts crosses the 16-token page boundary
def test_draft_verification_accepts_exactly_the_matching_prefix(runner, prompt_len):
    prompt = prompt_of(prompt_len, 7)
    truth = greedy_generate(runner, prompt, 12, PageAllocator(PAGES, 1))
    for n_good in range(0, 6):
        drafts = truth[1 : 1 + n_good] + [(truth[1 + n_good] + 1) % 4096] + [5, 6]
        alloc = PageAllocator(PAGES, 2)
        seq = Seq(prompt + truth[:1])
        req = request_for(
            seq,
            alloc,
            16,
            draft_tokens=drafts,
            draft_positions=list(range(len(seq.tokens), len(seq.tokens) + len(drafts))),
        )
        out = runner.execute(ForwardBatch([req]))[0]
        assert out.tokens == truth[1 : 2 + n_good], n_good
        # The accepted drafts' KV is valid: continuing from it reproduces the non-speculative run.
        seq.kv_len = len(seq.tokens) + n_good
        seq.tokens += out.tokens
        for _ in range(3):
            greedy_step(runner, [seq], alloc)
        assert seq.tokens[-3:] == truth[2 + n_good : 5 + n_good]
    all_good = truth[1:6]
    seq = Seq(prompt + truth[:1])
    req = request_for(
        seq,
        PageAllocator(PAGES),
        16,
        draft_tokens=all_good,
        draft_positions=list(range(len(seq.tokens), len(seq.tokens) + 5)),
    )
    assert runner.execute(ForwardBatch([req]))[0].tokens == truth[1:7]


def test_page_copy_forks_a_sequence(runner):
    """A child that shares page 0 and got a copy of page 1 decodes on even after the parent's page 1 changes."""
    prompt = prompt_of(20, 3)
    alloc = PageAllocator(PAGES, 4)
    parent = Seq(list(prompt))
    first = runner.execute(ForwardBatch([request_for(parent, alloc, 16)]))[0].slots[0].token
    child = Seq(prompt + [first], pages=[parent.pages[0], *alloc.take(1)], kv_len=20)
    runner.execute(ForwardBatch([], page_copies=[(parent.pages[1], child.pages[1])]))
    scribble = Seq(prompt_of(20, 99), pages=[parent.pages[1], *alloc.take(1)])
    runner.execute(ForwardBatch([request_for(scribble, alloc, 16)]))  # overwrites the parent's page 1
    for _ in range(6):
        greedy_step(runner, [child], alloc)
    assert child.tokens[21:] == greedy_generate(runner, prompt, 7, PageAllocator(PAGES, 5))[1:]


def test_brle_attention_mask_matches_hf_attention_mask(runner, tiny_llama):
    """Hiding the first k tokens with a BRLE mask == HF with those tokens masked out (same positions)."""
    tokens, hidden = prompt_of(24, 11), 5
    rows = [[hidden, i + 1 - hidden] if i >= hidden else [0, i + 1] for i in range(24)]
    out = runner.execute(
        ForwardBatch([request_for(Seq(tokens), PageAllocator(PAGES), 16, slots=[(23, LOGITS)], attention_masks=rows)])
    )[0]
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    attn = torch.ones(1, 24, dtype=torch.long)
    attn[0, :hidden] = 0
    with torch.no_grad():
        expected = ref(torch.tensor([tokens]), attention_mask=attn, position_ids=torch.arange(24)[None]).logits[0, -1]
    np.testing.assert_allclose(np.frombuffer(out.slots[0].logits, np.float32), expected.numpy(), atol=1e-4, rtol=0)
    causal = [[0, i + 1] for i in range(24)]
    a = runner.execute(
        ForwardBatch([request_for(Seq(tokens), PageAllocator(PAGES), 16, slots=[(23, LOGITS)], attention_masks=causal)])
    )[0]
    b = runner.execute(ForwardBatch([request_for(Seq(tokens), PageAllocator(PAGES), 16, slots=[(23, LOGITS)])]))[0]
    assert a.slots[0].logits == b.slots[0].logits


def _good(alloc) -> ForwardRequest:
    return request_for(Seq(prompt_of(6, 1)), alloc, 16)


BAD = {
    "out of the vocabulary": lambda a: request_for(Seq([1, 2, 99999]), a, 16),
    "positions for": lambda a: ForwardRequest([1, 2], [0], a.take(1), 0, [(1, Slot.argmax())]),
    "KV pages hold": lambda a: ForwardRequest([1] * 20, list(range(20)), a.take(1), 0, [(19, Slot.argmax())]),
    "kv_len -1": lambda a: ForwardRequest([1], [0], a.take(1), -1, [(0, Slot.argmax())]),
    "out of the KV pool": lambda a: ForwardRequest([1], [0], [PAGES + 3], 0, [(0, Slot.argmax())]),
    "same page twice": lambda a: ForwardRequest([1] * 20, list(range(20)), [3, 3], 0, [(19, Slot.argmax())]),
    "malformed attention mask": lambda a: ForwardRequest(
        [1, 2], [0, 1], a.take(1), 0, [(1, Slot.argmax())], attention_masks=[[0, 1], [0, 9]]
    ),
    "non-negative integers": lambda a: ForwardRequest(
        [1, 2], [0, 1], a.take(1), 0, [(1, Slot.argmax())], attention_masks=[[0, 1], [-1, 2]]
    ),
    "attends to nothing": lambda a: ForwardRequest(
        [1, 2], [0, 1], a.take(1), 0, [(1, Slot.argmax())], attention_masks=[[0, 1], [2]]
    ),
    "malformed logit mask": lambda a: ForwardRequest(
        [1], [0], a.take(1), 0, [(0, Slot.argmax())], logit_mask=[0, 5000]
    ),
    "whole uint32 run lengths": lambda a: ForwardRequest(
        [1], [0], a.take(1), 0, [(0, Slot.argmax())], logit_mask=b"\x00\x10\x00"
    ),
    "excludes every token": lambda a: ForwardRequest([1], [0], a.take(1), 0, [(0, Slot.argmax())], logit_mask=[4096]),
    "draft mask 0 excludes every token": lambda a: ForwardRequest(
        [1], [0], a.take(1), 0, [(0, Slot.argmax())], draft_tokens=[5], draft_positions=[1], draft_masks=[[4096]]
    ),
    "outside the request's": lambda a: ForwardRequest([1], [0], a.take(1), 0, [(3, Slot.argmax())]),
    "top_p": lambda a: ForwardRequest([1], [0], a.take(1), 0, [(0, Slot(SlotKind.TOP_P, top_p=1.5))]),
    "need a token sampler": lambda a: ForwardRequest(
        [1], [0], a.take(1), 0, [(0, LOGITS)], draft_tokens=[5], draft_positions=[1]
    ),
}


def test_a_mask_allowing_nothing_is_refused_only_where_a_token_is_sampled(runner):
    """Probes still read a row under a mask that excludes everything (every logit -inf); a sampler cannot."""
    probe = request_for(Seq(prompt_of(4, 2)), PageAllocator(PAGES), 16, slots=[(3, LOGITS)], logit_mask=[9])
    out = runner.execute(ForwardBatch([probe]))[0]
    assert out.error is None and np.isneginf(np.frombuffer(out.slots[0].logits, np.float32)).all()


@settings(deadline=None)  # a pure function, but its first example on a loaded 2-core machine can take 400 ms
@given(st.lists(st.booleans(), min_size=1, max_size=300), st.integers(0, 40))
def test_expanded_mask_blocks_exactly_the_false_bits_and_is_kept(bits, extra):
    vocab = len(bits) + extra
    runs = brle.encode(bits)
    expanded = logit_masks.expand(runs, vocab, "logit mask")
    assert (expanded.penalty == 0).tolist() == brle.decode(runs, vocab).tolist()
    assert np.isneginf(expanded.penalty.numpy()[~brle.decode(runs, vocab)]).all()
    assert expanded.allows_any == any(bits) and expanded.covered == len(bits)
    assert logit_masks.expand(brle.pack(runs), vocab, "logit mask") is expanded, "one expansion per distinct mask"
    with pytest.raises(brle.BrleError, match="covers"):
        logit_masks.expand(runs, len(bits) - 1, "logit mask")


@pytest.mark.parametrize("problem", sorted(BAD))
def test_bad_request_is_rejected_alone(runner, problem):
    alloc = PageAllocator(PAGES, 6)
    good_before = _good(alloc)
    expected = runner.execute(ForwardBatch([good_before]))[0].slots[0].token
    outs = runner.execute(ForwardBatch([_good(alloc), BAD[problem](alloc), _good(alloc)]))
    assert outs[1].error is not None and problem in outs[1].error, outs[1].error
    assert outs[0].error is None and outs[2].error is None
    assert outs[0].slots[0].token == outs[2].slots[0].token == expected
    assert runner.execute(ForwardBatch([_good(alloc)]))[0].slots[0].token == expected
