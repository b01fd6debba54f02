"""Loading checkpoints: both rope config forms, rope scaling, pool sizing, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from pie_workers.config import ModelConfig, UnsupportedModelError
from pie_workers.kv_pool import page_bytes
from pie_workers.loader import CheckpointError
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch
from safetensors.torch import load_file, save_file
from support.paged import LOGITS, PageAllocator, Seq, request_for
from transformers import AutoModelForCausalLM, LlamaConfig


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_both_rope_config_forms_parse_the_same(tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    assert "rope_parameters" in cfg
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    legacy["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    assert ModelConfig.from_dict(legacy).rope == ModelConfig.from_dict(cfg).rope


def test_llama3_rope_scaling_legacy_form_matches_hf(tmp_path):
    """A Llama 3.1-style checkpoint whose config uses the old ``rope_theta`` + ``rope_scaling`` keys."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=500000.0, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_dir(tmp_path).rope.rope_type == "llama3"

    runner = ModelRunner(tmp_path, RunnerSettings(num_pages=32))
    tokens = [random.Random(0).randrange(256) for _ in range(200)]  # well past the original 64-token context
    out = runner.execute(ForwardBatch([request_for(Seq(tokens), PageAllocator(32), 16, slots=[(199, LOGITS)])]))[0]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0, -1].numpy()
    np.testing.assert_allclose(np.frombuffer(out.slots[0].logits, np.float32), expected, atol=1e-4, rtol=0)


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    model = copy_model(tiny_llama, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelRunner(model, RunnerSettings(num_pages=4))


def test_unsupported_rope_type_is_named(tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 1e4, "rope_type": "longrope"}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_dict(cfg)


def with_weights_edited(src, dst, edit):
    """A copy of the model whose weights went through ``edit(dict)``."""
    model = copy_model(src, dst)
    weights = load_file(model / "model.safetensors")
    edit(weights)
    save_file(weights, model / "model.safetensors")
    return model


def test_missing_tensor_names_tensor(tiny_llama, tmp_path):
    model = with_weights_edited(tiny_llama, tmp_path / "m", lambda w: w.pop("model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"incomplete.*model\.layers\.2\.mlp\.down_proj\.weight"):
        ModelRunner(model, RunnerSettings(num_pages=4))


def test_wrong_shape_names_file_and_tensor(tiny_llama, tmp_path):
    model = with_weights_edited(tiny_llama, tmp_path / "m", lambda w: w.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight.*\[7\]"):
        ModelRunner(model, RunnerSettings(num_pages=4))


def test_missing_shard_names_file(tiny_llama, tmp_path):
    model = copy_model(tiny_llama, tmp_path / "m")
    weights = load_file(model / "model.safetensors")
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, model / file)
    (model / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert ModelRunner(model, RunnerSettings(num_pages=4)).num_pages == 4  # the sharded form loads
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        ModelRunner(model, RunnerSettings(num_pages=4))


def test_pool_sized_by_memory_fraction(tiny_llama):
    runner = ModelRunner(tiny_llama, RunnerSettings(num_pages=None, memory_fraction=0.01, backend="torch"))
    per_page = page_bytes(runner.cfg, 16, runner.cfg.num_kv_heads, torch.float32)
    assert runner.num_pages > 100
    assert runner.kv.k.numel() * 4 * 2 == runner.num_pages * per_page


def test_bfloat16_runner_tracks_float32(tiny_llama):
    """bf16 (the GPU default) runs through the same code; its logits stay close to fp32."""
    tokens = [random.Random(5).randrange(4096) for _ in range(40)]
    logits = []
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(tiny_llama, RunnerSettings(num_pages=8, dtype=dtype, backend="torch"))
        assert runner.kv.k.dtype == getattr(torch, dtype)
        out = runner.execute(ForwardBatch([request_for(Seq(tokens), PageAllocator(8), 16, slots=[(39, LOGITS)])]))
        logits.append(np.frombuffer(out[0].slots[0].logits, np.float32))
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[0] - logits[1]).max() < 0.05 * scale
    assert np.corrcoef(logits[0], logits[1])[0, 1] > 0.99
