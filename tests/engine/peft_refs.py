"""Test helper: PEFT on transformers as the reference for LoRA adapters (random adapters saved where a runner or a
replica loads them), and prompts of random tokens."""

from __future__ import annotations

import random

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from pie_workers.layers.lora import PEFT_MODULES
from transformers import AutoModelForCausalLM


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_adapter(model_dir, out_dir, targets=PEFT_MODULES, rank=4, alpha=8, seed=0, rslora=False) -> PeftModel:
    """A PEFT adapter with every matrix random (B too), saved to ``out_dir``; returns the PEFT model."""
    torch.manual_seed(seed)
    config = PeftLoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, use_rslora=rslora
    )
    model = get_peft_model(hf_model(model_dir), config).eval()
    model.save_pretrained(out_dir)
    return model


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]
