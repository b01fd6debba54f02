"""Fixtures of the SDK tests that need no replica: the tiny model's tokenizer and template, and family variants."""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_models import LLAMA3_TEMPLATE, QWEN3_TOKENS, StubModel, llama3_dir, variant


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> StubModel:
    """The tiny model's tokenizer and chat template without a replica: what grammars and matchers need."""
    return StubModel(tiny_llama)


@pytest.fixture(scope="module")
def qwen3(tiny_llama, tmp_path_factory) -> StubModel:
    path = variant(
        tiny_llama,
        tmp_path_factory.mktemp("qwen3") / "m",
        config={"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        plain=QWEN3_TOKENS,
    )
    return StubModel(path)


@pytest.fixture(scope="module")
def llama3_path(tiny_llama, tmp_path_factory) -> Path:
    return llama3_dir(tiny_llama, tmp_path_factory, LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def llama3(llama3_path) -> StubModel:
    return StubModel(llama3_path)


@pytest.fixture(scope="module")
def llama31(tiny_llama, tmp_path_factory) -> StubModel:
    # Only the family detection reads the template: 3.1+ templates carry the knowledge-date preamble.
    return StubModel(llama3_dir(tiny_llama, tmp_path_factory, "{{- 'Cutting Knowledge Date: December 2023' }}"))
