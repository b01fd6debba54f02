"""The embedded tiny model: byte-identical across builds and processes, and a loadable genuine HF checkpoint.

Determinism matters because caches and parity tests key on the bytes; loadability matters because the
runtime's reference comparisons go through stock `transformers`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pie_workers import cache, tiny_model
from pie_workers.tiny_model import VOCAB_SIZE, build_tiny_model, default_model_path

ARCHS = ("llama", "qwen3")
WORKERS_DIR = Path(__file__).resolve().parents[2] / "workers"
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


def digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Build both archs here while a fresh interpreter builds them again elsewhere, then compare bytes."""
    here = tmp_path_factory.mktemp("in_process")
    there = tmp_path_factory.mktemp("subprocess")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from pie_workers.tiny_model import build_tiny_model
        for arch in {ARCHS!r}:
            build_tiny_model(Path({str(there)!r}) / arch, arch=arch)
    """)
    env = {**os.environ, "PYTHONPATH": str(WORKERS_DIR), "PYTHONHASHSEED": "12345"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        paths = {arch: build_tiny_model(here / arch, arch=arch) for arch in ARCHS}
    finally:
        assert child.wait(timeout=120) == 0
    for arch in ARCHS:
        assert set(digests(paths[arch])) == EXPECTED_FILES
        assert digests(paths[arch]) == digests(there / arch), f"{arch}: subprocess build differs"
    return paths


@pytest.mark.parametrize("arch", ARCHS)
def test_rebuild_is_byte_identical(built, tmp_path, arch):
    assert digests(build_tiny_model(tmp_path, arch=arch)) == digests(built[arch])


def test_archs_share_tokenizer(built):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (built["llama"] / name).read_bytes() == (built["qwen3"] / name).read_bytes()


def test_seed_changes_weights_only(built, tmp_path):
    other = digests(build_tiny_model(tmp_path, arch="llama", seed=1))
    same = digests(built["llama"])
    assert other.pop("model.safetensors") != same.pop("model.safetensors")
    assert other == same


@pytest.fixture(scope="module")
def loaded(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return {
            arch: (
                AutoTokenizer.from_pretrained(built[arch], local_files_only=True),
                AutoModelForCausalLM.from_pretrained(built[arch], local_files_only=True).eval(),
            )
            for arch in ARCHS
        }


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer(loaded, arch):
    tok, _ = loaded[arch]
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token) == (0, 2, None)

    chat = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "héllo 中文"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nHi<|im_end|>\n<|im_start|>user\nhéllo 中文<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 2  # specials are single tokens, no BOS prepended
    assert tok.decode(ids) == prompt

    text = 'Straße über café, 你好世界 🚀 {"ok": true, "n": [1, 2.5, null]}\n    return x'
    ids = tok.encode(text)
    assert 0 not in ids and 1 not in ids  # nothing added around plain text
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")) / 2  # the merges actually compress


@pytest.mark.parametrize("arch", ARCHS)
def test_model_generates(loaded, arch):
    tok, model = loaded[arch]
    assert model.config.vocab_size == VOCAB_SIZE
    assert model.get_input_embeddings().weight.dtype == torch.float32
    ids = tok("The quick model", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 8)
    again = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, again)


def test_architecture_specifics(loaded):
    _, llama = loaded["llama"]
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()
    assert llama.config.num_key_value_heads == 2

    _, qwen = loaded["qwen3"]
    assert qwen.config.tie_word_embeddings
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    attn = qwen.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 64, 128)  # explicit head_dim != hidden / heads
    assert not torch.allclose(attn.q_norm.weight, torch.ones(64))  # loaded from the file, not default init


def test_weights_follow_the_recipe(built):
    from safetensors.torch import load_file

    for arch in ARCHS:
        tensors = load_file(built[arch] / "model.safetensors")
        assert ("lm_head.weight" in tensors) == (arch == "llama")
        for name, t in tensors.items():
            assert t.dtype == torch.float32 and t.is_contiguous()
            if name.endswith("norm.weight"):
                assert abs(t.mean().item() - 1.0) < 0.05 and 0.05 < t.std().item() < 0.15, name
            else:
                assert abs(t.mean().item()) < 0.005 and 0.015 < t.std().item() < 0.025, name


def test_default_model_path_builds_once(built, tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path))
    path = default_model_path("llama")
    assert path == tmp_path / "models" / f"tiny-llama-{tiny_model.BUILD_VERSION}"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dir left behind
    assert {k: v for k, v in digests(path).items() if not k.startswith(".")} == digests(built["llama"])

    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda *a, **k: pytest.fail("rebuilt a cached model"))
    assert default_model_path("llama") == path


def test_default_model_path_tolerates_a_concurrent_winner(built, tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path))
    final = tmp_path / "models" / f"tiny-qwen3-{tiny_model.BUILD_VERSION}"
    real_build = tiny_model.build_tiny_model

    def racing_build(out_dir, arch="llama", seed=0):
        real_build(final, arch=arch, seed=seed)  # the other builder finishes first...
        (final / cache.COMPLETE).write_text("v\n")
        return real_build(out_dir, arch=arch, seed=seed)  # ...while we are still building

    monkeypatch.setattr(tiny_model, "build_tiny_model", racing_build)
    assert default_model_path("qwen3") == final
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_import_is_cheap():
    heavy = "{'torch', 'transformers', 'tokenizers', 'safetensors'}"
    code = f"import sys, pie_workers.tiny_model; print(sorted({heavy} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(WORKERS_DIR)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
