"""Session fixtures: the tiny models (built once, offline) and one Ray instance for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    from pie_workers.tiny_model import default_model_path

    return default_model_path("llama")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    from pie_workers.tiny_model import default_model_path

    return default_model_path("qwen3")


@pytest.fixture(scope="session")
def ray_session():
    """Start a local Ray once per test session (starting it costs ~3 s)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="pie-test")
    yield ray
    ray.shutdown()
