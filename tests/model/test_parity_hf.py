"""The paged runner gives Hugging Face transformers' answers on the same weights, with either attention backend
(``torch``: our SDPA over gathered pages; ``vllm``: vLLM's CPU paged attention over its own cache layout, its
fused RMSNorm and rotary, its packed oneDNN matmuls).

Covers the two embedded architectures (Llama with GQA; Qwen3 with q/k norm, tied embeddings, explicit head_dim) and
HF-initialised Mistral (sliding window) and Qwen2 (q/k/v biases) checkpoints, which also exercises the loader on
each family and on a sharded index.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch
from support.paged import LOGITS, PageAllocator, Seq, greedy_generate, greedy_step, request_for
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

PAGES = 96


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def as_logits(slot_output) -> np.ndarray:
    return np.frombuffer(slot_output.logits, dtype=np.float32)


def build_hf_family(tmp_path, family: str):
    """A random-initialised HF checkpoint of a family the embedded builder doesn't cover, saved sharded."""
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if family == "mistral":
        cfg = MistralConfig(sliding_window=8, **common)
        cls = "MistralForCausalLM"
    else:
        cfg = Qwen2Config(tie_word_embeddings=False, **common)
        cls = "Qwen2ForCausalLM"
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF inits biases and norms to constants; randomise them so the test can see them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file(), cls
    return tmp_path


@pytest.fixture(params=["llama", "qwen3", "mistral", "qwen2"])
def model_dir(request, tmp_path):
    if request.param in ("llama", "qwen3"):
        return request.getfixturevalue(f"tiny_{request.param}")
    return build_hf_family(tmp_path, request.param)


@pytest.fixture(params=["torch", "vllm"])
def backend(request) -> str:
    return request.param


def test_prefill_and_decode_logits_match_hf(model_dir, backend):
    runner = ModelRunner(model_dir, RunnerSettings(num_pages=PAGES, backend=backend))
    ref = hf_model(model_dir)
    rng = random.Random(0)
    tokens = [rng.randrange(runner.cfg.vocab_size) for _ in range(40)]
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0].numpy()

    alloc = PageAllocator(PAGES, seed=3)
    seq = Seq(tokens[:30])
    req = request_for(seq, alloc, runner.page_size, slots=[(i, LOGITS) for i in range(30)])
    out = runner.execute(ForwardBatch([req]))[0]
    assert out.error is None
    seq.kv_len = 30
    got = [as_logits(s) for s in out.slots]
    for t in tokens[30:]:  # decode one token at a time
        seq.tokens.append(t)
        req = request_for(seq, alloc, runner.page_size, slots=[(0, LOGITS)])
        got.append(as_logits(runner.execute(ForwardBatch([req]))[0].slots[0]))
        seq.kv_len += 1
    np.testing.assert_allclose(np.stack(got), expected, atol=1e-4, rtol=0)
    assert sorted(seq.pages) != seq.pages, "pages should be scattered across the pool"


def test_greedy_tokens_match_hf_generate(model_dir, backend):
    runner = ModelRunner(model_dir, RunnerSettings(num_pages=PAGES, backend=backend))
    ref = hf_model(model_dir)
    prompt = [random.Random(1).randrange(runner.cfg.vocab_size) for _ in range(21)]
    got = greedy_generate(runner, prompt, 32, PageAllocator(PAGES, seed=5))
    expected = ref.generate(
        torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert got == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_equals_each_request_alone(arch, backend, request):
    runner = ModelRunner(request.getfixturevalue(f"tiny_{arch}"), RunnerSettings(num_pages=256, backend=backend))
    rng = random.Random(2)
    prompts = [[rng.randrange(runner.cfg.vocab_size) for _ in range(n)] for n in (1, 3, 7, 16, 17, 33, 50, 64)]
    alone = [greedy_generate(runner, p, 12, PageAllocator(256, seed=i)) for i, p in enumerate(prompts)]

    # Staggered start: request i joins at step i, so most batches mix prefill rows with decode rows.
    alloc = PageAllocator(256, seed=9)
    seqs = [Seq(list(p)) for p in prompts]
    steps = 0
    while any(len(s.tokens) - len(p) < 12 for s, p in zip(seqs, prompts, strict=True)):
        live = [
            s for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)) if i <= steps and len(s.tokens) - len(p) < 12
        ]
        greedy_step(runner, live, alloc)
        steps += 1
    assert [s.tokens[len(p) :] for s, p in zip(seqs, prompts, strict=True)] == alone
