"""Prefix-aware placement on a `pie start`ed cluster with two replicas of the tiny model: requests that share a long
system prompt go to one replica, whose prefix trie then serves that prompt from cache, and a second family of
prompts goes to the other replica (``[server] routing = "prefix"``, the default; see ingress/routing.py). The caches
are per user (``[cache] share = "user"``, the default) and narrowed by a request's ``cache_salt``."""

from __future__ import annotations

import openai
import pytest
from support.pie_procs import engine_status, started_pie

MODEL = "default"
FAMILY_A = "You are the support assistant of a shipping company; answer briefly and politely. " * 12
FAMILY_B = "Translate every sentence the user sends from French into German, keeping names as is. " * 12


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    # appended to the config's [[model]] table
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-prefix-routing"), "replicas = 2\n")


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


BAKERY = "You keep the books of a bakery in Lyon; answer every question in one short sentence. " * 10


def asked(pie, client, salt: str | None = None, user_text: str = "How many croissants today?") -> tuple[str, int]:
    """A greedy chat request (with ``cache_salt`` when given): its text and the prompt tokens it found cached."""
    before = sum(hits(pie).values())
    messages = [{"role": "system", "content": BAKERY}, {"role": "user", "content": user_text}]
    extra = {"cache_salt": salt} if salt is not None else {}
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=extra)
    return got.choices[0].message.content, sum(hits(pie).values()) - before


def test_a_cache_salt_narrows_reuse_to_the_same_user_and_salt(pie, api):
    """Alice's requests naming one salt share their prompt's pages (and are placed where they are); another salt,
    none, or another user naming the same salt find nothing of them, and greedy text is the same either way."""
    bob = openai.OpenAI(base_url=f"{pie['url']}/v1", api_key="tok-bob", max_retries=0, timeout=120)
    first, cold = asked(pie, api, "alice-books")
    again, warm = asked(pie, api, "alice-books")
    other, other_salt = asked(pie, api, "alice-other")
    plain, unsalted = asked(pie, api)
    bobs, bob_same_salt = asked(pie, bob, "alice-books")
    assert cold == 0 and warm > 0
    assert other_salt == 0 and unsalted == 0 and bob_same_salt == 0
    assert first == again == other == plain == bobs

    found = []
    for salt in ("turns", "turns", "other-turns"):  # the Responses route takes it too
        before = sum(hits(pie).values())
        got = api.responses.create(
            model=MODEL, instructions=BAKERY, input="Bread?", max_output_tokens=4, extra_body={"cache_salt": salt}
        )
        assert got.status in ("completed", "incomplete")
        found.append(sum(hits(pie).values()) - before)
    assert found[0] == 0 and found[1] > 0 and found[2] == 0, found


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"]])
def test_a_malformed_cache_salt_is_a_400_naming_it(pie, api, salt):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": salt})
    assert refused.value.body["param"] == "cache_salt", refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={"cache_salt": salt})
    assert refused.value.body["param"] == "cache_salt", refused.value.body
