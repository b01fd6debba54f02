"""Prefix-aware placement on a `pie start`ed cluster with two replicas of the tiny model: requests that share a long
system prompt go to one replica, whose prefix trie then serves that prompt from cache, and a second family of
prompts goes to the other replica (``[server] routing = "prefix"``, the default; see prefix_routing.py)."""

from __future__ import annotations

import openai
import pytest
from pie_procs import engine_status, started_pie

MODEL = "default"
FAMILY_A = "You are the support assistant of a shipping company; answer briefly and politely. " * 12
FAMILY_B = "Translate every sentence the user sends from French into German, keeping names as is. " * 12


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    # appended to the config's [[model]] table
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-prefix-routing"), "replicas = 2\n")


@pytest.fixture(scope="module")
def api(pie) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pie['url']}/v1", api_key="tok-alice", max_retries=0, timeout=120)


def hits(pie) -> dict[int, int]:
    """Prompt tokens each replica has served from its prefix trie so far."""
    rows = engine_status(pie)["replicas"]
    assert [r["state"] for r in rows] == ["serving", "serving"], rows
    return {r["replica"]: r["prefix_hit_tokens"] for r in rows}


def ask(api, system: str, question: str):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)


def test_a_shared_system_prompt_stays_on_one_replica_and_another_family_takes_the_other(pie, api):
    before = hits(pie)
    prompt_tokens = [ask(api, FAMILY_A, f"Where is parcel {i}?").usage.prompt_tokens for i in range(5)]
    after_a = hits(pie)
    gained_a = {r: after_a[r] - before[r] for r in before}
    a_replica = max(gained_a, key=gained_a.get)
    other = 1 - a_replica
    # the first request computed the prompt; the four after it found its pages (all but the last partial page and
    # the question) on the same replica, and the other replica got none of them
    assert gained_a[other] == 0, gained_a
    assert gained_a[a_replica] >= 4 * (min(prompt_tokens) - 48), (gained_a, prompt_tokens)

    for i in range(5):
        ask(api, FAMILY_B, f"Bonjour, je m'appelle Marie et j'ai {i} chats.")
    after_b = hits(pie)
    gained_b = {r: after_b[r] - after_a[r] for r in before}
    assert gained_b[a_replica] == 0 and gained_b[other] > 0, gained_b  # the second family: the idle replica

    ask(api, FAMILY_A, "And parcel 99?")  # the first family still goes where its prefix is
    assert hits(pie)[a_replica] > after_b[a_replica]


def test_responses_are_placed_too(pie, api):
    before = hits(pie)
    for i in range(2):
        got = api.responses.create(model=MODEL, instructions=FAMILY_B, input=f"Phrase {i}", max_output_tokens=4)
        assert got.status in ("completed", "incomplete")
    after = hits(pie)
    assert sum(after.values()) > sum(before.values())  # the second found the first's instructions cached
    first = api.responses.create(model=MODEL, input="Start a story.", max_output_tokens=4)
    for _ in range(3):  # each turn goes where the one it continues went, whose snapshot is there
        then = api.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=4)
        assert then.status in ("completed", "incomplete") and then.usage.input_tokens_details.cached_tokens > 0
        first = then
