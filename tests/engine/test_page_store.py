"""PageStore: free list, content-addressed trie with dedup, reference counts, LRU eviction of the prefix cache."""

from __future__ import annotations

import pickle

import pytest
from pie_workers.engine import OutOfPages, PageStats, PageStore

P = 4  # page size


def page(start: int, tokens: list[int] | None = None) -> tuple[list[int], list[int]]:
    """One full page: tokens (default: start..) at positions start..start+P."""
    return tokens if tokens is not None else list(range(start, start + P)), list(range(start, start + P))


def commit_chain(store: PageStore, pages: list[list[int]], salt: bytes = b""):
    """Commit a chain of pages the way a context does (retain the new tail, release the old); returns the tail."""
    tail = None
    for i, tokens in enumerate(pages):
        [pid] = store.allocate(1)
        node, _ = store.commit(tail, pid, *page(i * P, tokens), salt=salt)
        if tail is not None:
            store.release(tail)
        tail = node
    return tail


def assert_accounted(store: PageStore) -> None:
    s = store.stats()
    assert s.free + s.working + s.committed + s.cached == s.total == store.num_pages
    trie = [n.page_id for n in store.nodes()]
    assert len(trie) == s.committed + s.cached == len(set(trie))
    assert not set(trie) & set(store.free_page_ids())


def test_allocate_free_and_stats():
    store = PageStore(8, P)
    a = store.allocate(3)
    assert a == [0, 1, 2]
    assert store.stats() == PageStats(total=8, free=5, working=3, committed=0, cached=0)
    store.free(a[:2])
    assert store.stats().free == 7 and store.stats().working == 1
    with pytest.raises(ValueError, match="not distinct allocated working pages"):
        store.free([a[0]])
    with pytest.raises(ValueError, match="not distinct allocated working pages"):
        store.free([a[2], a[2]])
    assert store.allocate(0) == []
    assert_accounted(store)


def test_commit_dedups_identical_pages_and_counts_refs():
    store = PageStore(8, P)
    x, y = store.allocate(2)
    nx, kept_x = store.commit(None, x, *page(0))
    ny, kept_y = store.commit(None, y, *page(0))
    assert kept_x and not kept_y and nx is ny
    assert nx.refs == 2 and nx.page_id == x
    assert store.stats().committed == 1 and store.stats().working == 0 and store.stats().free == 7
    # a different salt (another adapter) is a different page
    [z] = store.allocate(1)
    nz, kept_z = store.commit(None, z, *page(0), salt="adapter-1")
    assert kept_z and nz is not nx
    # a child counts as a reference of its parent
    [c] = store.allocate(1)
    child, _ = store.commit(nx, c, *page(P))
    assert nx.refs == 3 and child.refs == 1
    assert store.chain(child) == (x, c)
    assert_accounted(store)


def test_commit_rejects_partial_pages_and_foreign_pages():
    store = PageStore(4, P)
    [a] = store.allocate(1)
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        store.commit(None, a, [1, 2], [0, 1])
    with pytest.raises(ValueError, match="not an allocated working page"):
        store.commit(None, 3, *page(0))


def test_released_pages_stay_cached_and_are_reused():
    store = PageStore(8, P)
    tail = commit_chain(store, [[1, 2, 3, 4], [5, 6, 7, 8]])
    store.release(tail)
    s = store.stats()
    assert (s.committed, s.cached) == (0, 2)  # no chain needs either page: both are cache
    assert tail.parent.refs == 1 and tail.refs == 0  # only the leaf is evictable right away
    node, n = store.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(9)))
    assert n == 2 and node is tail
    node, n = store.match_prefix([1, 2, 3, 4, 0, 0, 0, 0], list(range(8)))
    assert n == 1 and node is tail.parent
    assert store.match_prefix([1, 2, 3, 4], list(range(1, 5))) == (None, 0)  # positions are part of the key
    assert store.match_prefix([1, 2, 3, 4], list(range(4)), salt=b"other") == (None, 0)
    store.retain(node)
    assert (store.stats().committed, store.stats().cached) == (1, 1)
    with pytest.raises(ValueError, match="no chain ends at it"):
        store.release(tail)
    assert_accounted(store)


def test_allocate_evicts_lru_leaves_first_then_their_parents():
    store = PageStore(5, P)
    a = commit_chain(store, [[1] * P, [2] * P])  # a1 -> a2
    b = commit_chain(store, [[3] * P])
    c = commit_chain(store, [[4] * P])
    a1 = a.parent.page_id
    store.release(a)
    store.release(c)
    store.release(b)
    in_trie = lambda: {n.page_id for n in store.nodes()}
    # LRU among cached leaves: a2 (released first), then c; a1 only becomes evictable once a2 is gone,
    # and its last use (when a2 was committed) predates everything else.
    assert store.stats().free == 1
    store.allocate(2)
    assert in_trie() == {a1, b.page_id, c.page_id}
    store.allocate(1)
    assert in_trie() == {b.page_id, c.page_id}
    store.allocate(1)
    assert in_trie() == {b.page_id}
    assert_accounted(store)


def test_match_prefix_refreshes_lru():
    store = PageStore(2, P)
    a = commit_chain(store, [[1] * P])
    b = commit_chain(store, [[2] * P])
    store.release(a)
    store.release(b)
    store.match_prefix([1] * P, list(range(P)))  # a is now more recent than b
    store.allocate(1)
    assert store.match_prefix([1] * P, list(range(P)))[1] == 1
    assert store.match_prefix([2] * P, list(range(P)))[1] == 0


def test_out_of_pages_is_clear_and_evicts_nothing():
    store = PageStore(6, P)
    held = commit_chain(store, [[1] * P, [2] * P])
    cached = commit_chain(store, [[3] * P])
    store.release(cached)
    store.allocate(2)
    before = store.stats()
    with pytest.raises(OutOfPages, match=r"asked for 4, but only 2 of the pool's 6 pages can be had") as err:
        store.allocate(4)
    assert (err.value.requested, err.value.available, err.value.total) == (4, 2, 6)
    assert store.stats() == before
    assert store.match_prefix([3] * P, list(range(P)))[1] == 1  # the cache survived the failed allocation
    again = pickle.loads(pickle.dumps(err.value))
    assert isinstance(again, OutOfPages) and str(again) == str(err.value)
    assert store.allocate(2) and store.stats().cached == 0
    assert held.refs == 1
    assert_accounted(store)


def test_chain_cache_is_consistent_after_shared_prefixes():
    store = PageStore(16, P)
    a = commit_chain(store, [[1] * P, [2] * P, [3] * P])
    b = commit_chain(store, [[1] * P, [2] * P, [4] * P])
    assert store.chain(a)[:2] == store.chain(b)[:2]
    assert store.chain(a)[2] != store.chain(b)[2]
    assert store.stats().committed == 4 and store.stats().free == 12
    for node in (a, b):
        walk, up = [], node
        while up is not None:
            walk.append(up.page_id)
            up = up.parent
        assert store.chain(node) == tuple(reversed(walk))
