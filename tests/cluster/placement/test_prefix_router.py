"""The prefix-aware router on its own (no Ray): which replica a request goes to, and what it remembers."""

from __future__ import annotations

from pie_cluster.ingress.routing import BLOCK_CHARS, LOAD_FACTOR, LOAD_SLACK, PrefixRouter, Prompt, block_hashes

A, B = "tcp://a", "tcp://b"
SYSTEM_1 = "You are a careful assistant for a shipping company. " * 20
SYSTEM_2 = "You translate legal documents between French and German. " * 20


def test_block_hashes_are_chained_over_full_blocks():
    text = "x" * (3 * BLOCK_CHARS + 5)
    hashes = block_hashes(text)
    assert len(hashes) == 3 and len(set(hashes)) == 3  # same blocks, different prefixes: different hashes
    assert block_hashes(text[: 2 * BLOCK_CHARS]) == hashes[:2]
    assert block_hashes("y" + text)[:1] != hashes[:1]
    assert block_hashes("short") == []


def test_a_shared_prefix_goes_where_it_went_before_and_a_new_one_to_the_least_loaded():
    router = PrefixRouter()
    first = router.choose("m", [A, B], SYSTEM_1 + "question one")
    other = router.choose("m", [A, B], SYSTEM_2 + "question one")
    assert other != first  # no match anywhere: the least loaded one
    for i in range(5):  # both busy alike: each family keeps to its replica
        assert router.choose("m", [A, B], SYSTEM_1 + f"question {i}") == first
        assert router.choose("m", [A, B], SYSTEM_2 + f"question {i}") == other
    assert router.in_flight("m", first) == 6 and router.in_flight("m", other) == 6


def test_the_longest_match_wins():
    router = PrefixRouter()
    longer = SYSTEM_1 + "Here is a long shared few-shot preamble that only some requests carry. " * 5
    assert router.choose("m", [A, B], SYSTEM_1) == A
    while router.in_flight("m", A) <= LOAD_SLACK:  # A too busy: the longer prompt goes to B
        router.choose("m", [A], "filler")  # one replica: nothing counted, so count A by hand
        router._replicas["m", A].in_flight += 1
    assert router.choose("m", [A, B], longer) == B
    for key in (A, B):
        while router.in_flight("m", key):
            router.finished("m", key)
    # A has seen SYSTEM_1, B SYSTEM_1 and the preamble: B matches longer
    assert router.choose("m", [A, B], longer + "and a question") == B
    assert router.choose("m", [A, B], SYSTEM_1 + "another question") == A  # equal match: the less loaded


def test_load_overrides_affinity_past_the_threshold():
    router = PrefixRouter()
    target = router.choose("m", [A, B], SYSTEM_1 + "q")
    other = B if target == A else A
    limit = LOAD_FACTOR * 0 + LOAD_SLACK  # the other replica has nothing in flight
    while router.in_flight("m", target) <= limit:
        assert router.choose("m", [A, B], SYSTEM_1 + "q") == target
    assert router.choose("m", [A, B], SYSTEM_1 + "q") == other  # too loaded: the least loaded takes it
    # the other replica has that prefix now too: equal matches, so the less loaded of the two
    assert router.choose("m", [A, B], SYSTEM_1 + "q") == other
    for _ in range(router.in_flight("m", target)):
        router.finished("m", target)
    assert router.in_flight("m", target) == 0
    router.finished("m", target)  # an extra ending never goes negative
    assert router.in_flight("m", target) == 0


def test_memory_is_bounded_and_old_prefixes_are_forgotten_first():
    router = PrefixRouter(max_blocks=50)
    for i in range(200):
        key = router.choose("m", [A, B], f"prompt family {i:04d} " * 40)
        router.finished("m", key)
    assert router.remembered("m", A) <= 50 and router.remembered("m", B) <= 50
    recent = f"prompt family {199:04d} " * 40
    where = router.choose("m", [A, B], recent)
    router.finished("m", where)
    assert router.choose("m", [A, B], recent) == where


def test_least_loaded_mode_ignores_prefixes_and_rotates_ties():
    router = PrefixRouter("least_loaded")
    picks = [router.choose("m", [A, B], SYSTEM_1 + f"q{i}") for i in range(4)]
    assert picks.count(A) == 2 and picks.count(B) == 2
    assert router.remembered("m", A) == 0
    router.finished("m", A)
    router.finished("m", A)
    assert router.choose("m", [A, B], SYSTEM_1) == A
    for key in (A, B):  # idle again: ties rotate rather than always taking the first
        while router.in_flight("m", key):
            router.finished("m", key)
    assert {router.choose("m", [A, B], "x"), router.choose("m", [A, B], "x")} == {A, B}


def test_one_replica_costs_nothing_and_models_are_kept_apart():
    router = PrefixRouter()
    assert router.choose("m", [A], SYSTEM_1) == A
    assert router.in_flight("m", A) == 0 and router.remembered("m", A) == 0
    router.choose("m", [A, B], SYSTEM_1)
    assert router.remembered("other", A) == 0 and router.remembered("other", B) == 0
    router.forget("m", keep=[B])
    assert router.remembered("m", A) == 0 and router.in_flight("m", A) == 0


def test_requests_with_the_same_first_messages_share_a_text_prefix():
    system = {"role": "system", "content": SYSTEM_1}
    one = Prompt.of("m", [system, {"role": "user", "content": "first question"}])
    two = Prompt.of("m", [system, {"role": "user", "content": "second one"}])
    shared = len(SYSTEM_1) // BLOCK_CHARS
    assert block_hashes(one.text)[:shared] == block_hashes(two.text)[:shared]
    other = Prompt.of("m", [{"role": "system", "content": SYSTEM_2}, {"role": "user", "content": "first question"}])
    assert block_hashes(other.text)[0] != block_hashes(one.text)[0]


def test_a_continuation_follows_the_request_it_continues_within_the_load_limit():
    router = PrefixRouter()
    first = router.choose("m", [A, B], "", tag="resp_1")
    other = B if first == A else A
    router.choose("m", [A, B], "", tag="filler")  # to the other
    router.finished("m", first)
    router.choose("m", [A, B], "", tag="filler2")  # to first again, the less loaded: it was picked last
    assert router.in_flight("m", first) == 1 and router.in_flight("m", other) == 1
    # equally busy, and first picked more recently: without the continuation, the other would take it
    assert router.choose("m", [other, first], "new items", follows="resp_1") == first
    while router.in_flight("m", first) <= LOAD_SLACK + 2:  # far busier than the other: load wins
        router._replicas["m", first].in_flight += 1
    assert router.choose("m", [A, B], "more items", follows="resp_1") == other
    assert PrefixRouter("least_loaded").choose("m", [A, B], "", follows="resp_1") == A  # no pins there


def test_a_users_prefix_places_only_that_users_requests_with_the_same_salt_unless_prefixes_are_shared():
    """The replicas cache per user and salt (``[cache] share = "user"``): another user's or salt's request gains
    nothing from where a prompt went, so it goes by load; with ``share = "cluster"`` any user's request follows it."""
    for shared in (False, True):
        router = PrefixRouter(shared_prefixes=shared)
        alice = router.choose("m", [A, B], SYSTEM_1 + "question one", user="alice")  # stays in flight there
        bob = router.choose("m", [A, B], SYSTEM_1 + "question two", user="bob")
        router.finished("m", bob)
        assert (bob == alice) is shared, "bob's request follows alice's prompt only where their caches are shared"
        salted = router.choose("m", [A, B], SYSTEM_1 + "question three", user="alice", cache_salt="s")
        router.finished("m", salted)
        assert salted != alice, "another salt is another cache: the request goes by load"
        assert router.choose("m", [A, B], SYSTEM_1 + "question four", user="alice") == alice


def test_the_prompt_carries_the_requests_cache_salt():
    assert Prompt.of("m", ["hi"], cache_salt="s").cache_salt == "s"
    assert Prompt.of("m", ["hi"]).cache_salt is None
