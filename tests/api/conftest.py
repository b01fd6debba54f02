"""Fixtures of the API tests: each module starts its own cluster (its ``pie`` fixture, with the config it tests)."""

import openai
import pytest


@pytest.fixture(scope="module")
def api(pie) -> openai.OpenAI:
    """The official ``openai`` client as alice, against the module's cluster."""
    return openai.OpenAI(base_url=f"{pie['url']}/v1", api_key="tok-alice", max_retries=0, timeout=120)
