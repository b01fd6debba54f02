"""Fixtures of the engine tests: the tiny Llama's runner that ``engine_harness`` drives in this process."""

from __future__ import annotations

import pytest
from pie_workers.runner import ModelRunner, RunnerSettings
from support.engine_harness import PAGES


@pytest.fixture(scope="module")
def runner(tiny_llama):
    """A real runner over the tiny Llama with ``engine_harness.PAGES`` pages (a module may override it)."""
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES))
