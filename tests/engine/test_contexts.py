"""ContextTable, case by case: commit and dedup, fork, truncate, snapshots and their owners, scoped destroy, prefix
reuse, salts, and the error messages. The same invariants over random operation sequences are in
``test_contexts_properties.py``.
"""

from __future__ import annotations

import pytest
from pie_workers.engine import ContextError, ContextTable, OutOfPages, PageStore
from pie_workers.wire.pages import pages_for

P = 4


def make(num_pages: int = 16) -> tuple[PageStore, ContextTable]:
    store = PageStore(num_pages, P)
    return store, ContextTable(store)


def working(table: ContextTable, ctx: int) -> list[tuple[int, int]]:
    """(token, position) of each of the context's working (uncommitted) tokens."""
    return [(t, p) for t, p, _ in table.holding(ctx).lineage]


def fill(table: ContextTable, ctx: int, tokens: list[int], commit: bool = True, salt: bytes = b"") -> None:
    """What the SDK's flush does: reserve, forward (here: record), commit the full pages."""
    v = table.view(ctx)
    need = pages_for(v.working_tokens + len(tokens), P) - v.working_pages
    table.reserve(ctx, max(0, need))
    table.record(ctx, tokens, range(v.seq_len, v.seq_len + len(tokens)), salt=salt)
    if commit:
        table.commit(ctx, table.view(ctx).working_tokens // P)


def test_identical_first_pages_share_one_physical_page():
    store, table = make()
    a, b = table.create("alice"), table.create("bob")
    fill(table, a, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    fill(table, b, [1, 2, 3, 4, 5, 6, 7, 0, 9])
    va, vb = table.view(a), table.view(b)
    assert va.page_ids[0] == vb.page_ids[0]  # shared first page
    assert va.page_ids[1] != vb.page_ids[1]  # the second pages differ in one token
    assert (va.committed_pages, va.working_pages, va.working_tokens, va.seq_len) == (2, 1, 1, 9)
    assert va.kv_len == va.seq_len and len(va.page_ids) == 3
    s = store.stats()
    assert (s.committed, s.working, s.cached, s.free) == (3, 2, 0, 11)  # 4 pages reserved per context, one deduped
    c = table.create("carol")
    fill(table, c, [1, 2, 3, 4], salt=b"adapter-7")  # same tokens under another adapter: not shared
    assert table.view(c).page_ids[0] != va.page_ids[0]


def test_fork_shares_committed_pages_and_copies_only_token_pages():
    store, table = make()
    a = table.create("alice")
    fill(table, a, list(range(10)))  # 2 committed pages, 2 working tokens in 1 working page
    table.reserve(a, 2)  # two more empty working pages
    before = store.stats()
    b, copies = table.fork(a)
    after = store.stats()
    assert after.committed == before.committed and after.working == before.working + 3
    va, vb = table.view(a), table.view(b)
    assert vb.page_ids[:2] == va.page_ids[:2]
    assert copies == [(va.page_ids[2], vb.page_ids[2])]
    assert (vb.seq_len, vb.working_pages, vb.working_tokens) == (10, 3, 2)
    assert working(table, b) == working(table, a) == [(8, 8), (9, 9)]
    assert not set(vb.page_ids[2:]) & set(va.page_ids)


def test_everything_destroyed_returns_pages_to_free_or_cache():
    store, table = make()
    a = table.create("alice")
    fill(table, a, list(range(11)))
    b, _ = table.fork(a)
    table.save(b, "s")
    fill(table, b, [7] * 6)
    table.destroy(a)
    table.destroy(b)
    assert store.stats().committed > 0  # the snapshot still holds its chain
    table.delete("alice", "s")
    s = store.stats()
    assert s.working == 0 and s.committed == 0 and s.free + s.cached == s.total
    assert len(store.allocate(16)) == 16


def test_error_messages_name_the_problem():
    _, table = make()
    a = table.create("alice")
    with pytest.raises(ContextError, match="unknown context id 99"):
        table.view(99)
    table.reserve(a, 1)
    with pytest.raises(
        ContextError, match=r"cannot record 5 tokens into context 1: its 1 working pages have room for 4"
    ):
        table.record(a, [1, 2, 3, 4, 5], range(5))
    with pytest.raises(ContextError, match="3 tokens but 2 positions"):
        table.record(a, [1, 2, 3], [0, 1])
    table.record(a, [1, 2, 3], range(3))
    with pytest.raises(ContextError, match="cannot truncate 4 tokens from context 1: only 3 tokens"):
        table.truncate(a, 4)
    with pytest.raises(ContextError, match="cannot commit 1 pages of context 1: that needs 4 working tokens, it has 3"):
        table.commit(a, 1)
    with pytest.raises(ContextError, match="negative"):
        table.truncate(a, -1)
    table.record(a, [4], [3])
    table.commit(a, 1)
    table.reserve(a, 1)
    table.record(a, [5, 6, 7, 8], [3, 4, 5, 6])  # overlaps the committed position 3
    with pytest.raises(ContextError, match="position 3 is not greater than the highest committed position 3"):
        table.commit(a, 1)
    table.truncate(a, 4)
    table.reserve(a, 1)
    with pytest.raises(ContextError, match="cannot release 3 working pages of context 1: only 2 of its 2"):
        table.release_working(a, 3)
    table.release_working(a, 2)
    assert table.view(a).working_pages == 0
    with pytest.raises(OutOfPages, match="asked for 99"):
        table.reserve(a, 99)
    table.destroy(a)
    with pytest.raises(ContextError, match="context 1 was destroyed"):
        table.destroy(a)


def test_truncate_keeps_pages_and_commit_moves_only_full_pages():
    store, table = make()
    a = table.create("alice")
    fill(table, a, list(range(6)), commit=False)
    table.truncate(a, 3)
    v = table.view(a)
    assert (v.seq_len, v.working_pages, v.working_tokens) == (3, 2, 3)
    table.record(a, [9, 9], [3, 4])
    table.commit(a, 1)
    v = table.view(a)
    assert (v.committed_pages, v.working_pages, v.working_tokens, v.seq_len) == (1, 1, 1, 5)
    assert working(table, a) == [(9, 4)]
    assert store.stats().committed == 1


def test_snapshots_save_open_take_delete_and_owner_isolation():
    store, table = make(32)
    a = table.create("alice", instance="run-1")
    fill(table, a, list(range(6)))  # 1 committed page + 2 working tokens
    table.reserve(a, 2)
    copies = table.save(a, "sys")
    assert len(copies) == 1  # only the page holding tokens is copied; empty reserved pages are not kept
    with pytest.raises(ContextError, match="snapshot 'sys' already exists for user 'alice'"):
        table.save(a, "sys")
    snap = table.view_snapshot("alice", "sys")
    assert (snap.seq_len, snap.working_pages) == (6, 1) and snap.page_ids[0] == table.view(a).page_ids[0]
    # another user sees nothing, and can use the same name independently
    assert table.open("bob", "sys") is None and table.take("bob", "sys") is None
    with pytest.raises(ContextError, match="no snapshot named 'sys' for user 'bob'"):
        table.delete("bob", "sys")
    b = table.create("bob")
    table.save(b, "sys")
    assert table.snapshots_of("bob") == ["sys"]
    # the snapshot outlives its context and the inferlet that made it
    assert table.destroy_all("alice", instance="run-1") == 1
    opened = table.open("alice", "sys", instance="run-2")
    assert opened is not None
    c, copies = opened
    vc = table.view(c)
    assert (vc.seq_len, vc.working_tokens) == (6, 2) and copies == [(snap.page_ids[1], vc.page_ids[1])]
    assert working(table, c) == [(4, 4), (5, 5)]
    assert table.snapshots_of("alice") == ["sys"]  # open leaves the snapshot in place
    name, _ = table.snapshot(c)
    assert name.startswith("snapshot-") and table.snapshots_of("alice") == sorted(["sys", name])
    working_before = store.stats().working
    d = table.take("alice", "sys")
    assert table.view(d).page_ids == snap.page_ids and store.stats().working == working_before  # no copies
    assert table.take("alice", "sys") is None and table.snapshots_of("alice") == [name]
    table.delete("alice", name)
    assert table.snapshots_of("alice") == []
    assert table.owner_of(d) == "alice" and sorted(table.contexts_of("alice")) == [c, d]
    assert table.contexts_of("alice", instance="run-2") == [c]


def test_destroy_all_is_scoped_to_the_instance():
    _, table = make()
    a1, a2 = table.create("alice", instance="i1"), table.create("alice", instance="i2")
    child, _ = table.fork(a1)
    assert table.destroy_all("alice", instance="i1") == 2
    assert table.contexts_of("alice") == [a2]
    with pytest.raises(ContextError, match="was destroyed"):
        table.view(child)


def test_reuse_prefix_adopts_cached_pages():
    store, table = make()
    prompt = list(range(100, 111))  # 2 full pages + 3 tokens
    a = table.create("alice")
    fill(table, a, prompt)
    pages = table.view(a).page_ids[:2]
    table.destroy(a)
    assert (store.stats().cached, store.stats().committed) == (2, 0)
    b = table.create("bob")
    assert table.reuse_prefix(b, prompt, range(len(prompt))) == 8
    vb = table.view(b)
    assert vb.page_ids == pages and vb.seq_len == 8
    assert store.stats().cached == 0
    # only the rest of the prompt needs a forward; a different salt matches nothing
    fill(table, b, prompt[8:])
    assert table.view(b).seq_len == 11
    c = table.create("carol")
    assert table.reuse_prefix(c, prompt, range(len(prompt)), salt=b"lora") == 0
    with pytest.raises(ContextError, match="has 3 working tokens"):
        table.reuse_prefix(b, prompt, range(len(prompt)))


def test_commit_of_mixed_salt_page_does_not_share_with_uniform_salt():
    _, table = make()
    a, b = table.create("alice"), table.create("alice")
    table.reserve(a, 1)
    table.record(a, [1, 2], [0, 1], salt=b"x")
    table.record(a, [3, 4], [2, 3], salt=b"y")
    table.commit(a, 1)
    fill(table, b, [1, 2, 3, 4], salt=b"x")
    assert table.view(a).page_ids[0] != table.view(b).page_ids[0]
