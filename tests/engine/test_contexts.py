"""ContextTable: commit/dedup, fork, snapshots, errors, and a stateful property test over random operation sequences.

One file though it passes 400 lines: the unit cases and the stateful property test check the same invariants
against the same simulated pool.

The property test keeps a simulated KV pool (what each physical page slot holds) and writes recorded tokens into it
through the context's page table, executing the page copies the table hands back. It then checks that every context
and snapshot reads exactly its own token history through its page ids: that is the end-to-end meaning of dedup,
O(1) fork and copy-on-fork being right.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pie_workers.engine import ContextError, ContextTable, OutOfPages, PageStore
from pie_workers.wire.pages import pages_for

P = 4


def make(num_pages: int = 16) -> tuple[PageStore, ContextTable]:
    store = PageStore(num_pages, P)
    return store, ContextTable(store)


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
    assert table.lineage(b) == table.lineage(a) == [(8, 8), (9, 9)]
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
    assert table.lineage(a) == [(9, 4)]
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
    assert table.lineage(c) == [(4, 4), (5, 5)]
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


# -- stateful property test -----------------------------------------------------------------------------------------

PS, NP = 2, 20
OWNERS = st.sampled_from(["alice", "bob", "carol"])
NAMES = st.sampled_from(["a", "b"])
IDX = st.integers(0, 7)
SALTS = st.sampled_from([b"", b"", b"", b"s"])


class ContextMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = PageStore(NP, PS)
        self.table = ContextTable(self.store)
        self.kv = {p: [None] * PS for p in range(NP)}  # what each physical slot holds
        self.hist: dict[int, list] = {}  # per live context: (token, position, salt) of every slot up to seq_len
        self.snaps: dict[tuple[str, str], list] = {}
        self.dead: list[int] = []
        self.gone: list[list] = []  # histories of destroyed contexts: their committed pages may still be cached

    # -- helpers --

    def pick(self, i: int) -> int:
        ids = sorted(self.hist)
        return ids[i % len(ids)]

    def avail(self) -> int:
        s = self.store.stats()
        return s.free + s.cached

    def fingerprint(self):
        return (
            self.store.stats(),
            self.table.stats(),
            {c: self.table.view(c) for c in self.hist},
            {k: self.table.view_snapshot(*k) for k in self.snaps},
            sorted((n.page_id, n.refs) for n in self.store.nodes()),
            sorted(self.store.free_page_ids()),
        )

    def attempt(self, expect_ok: bool, fn):
        """Run fn; it must succeed iff expect_ok, and a failure must leave no trace."""
        before = self.fingerprint()
        try:
            result = fn()
        except (ContextError, OutOfPages):
            assert not expect_ok
            assert self.fingerprint() == before
            return False, None
        assert expect_ok
        return True, result

    def run_copies(self, copies) -> None:
        assert len({d for _, d in copies}) == len(copies)
        contents = [list(self.kv[s]) for s, _ in copies]
        for (_, d), content in zip(copies, contents, strict=True):
            self.kv[d] = content

    # -- rules --

    @rule(owner=OWNERS, instance=st.sampled_from([None, "i1"]))
    def create(self, owner, instance):
        self.hist[self.table.create(owner, instance)] = []

    @precondition(lambda self: self.hist)
    @rule(i=IDX, n=st.integers(0, 4))
    def reserve(self, i, n):
        ctx = self.pick(i)
        self.attempt(n <= self.avail(), lambda: self.table.reserve(ctx, n))

    @precondition(lambda self: self.hist)
    @rule(i=IDX, n=st.integers(0, 3))
    def release_working(self, i, n):
        ctx = self.pick(i)
        v = self.table.view(ctx)
        empty = v.working_pages - pages_for(v.working_tokens, PS)
        self.attempt(n <= empty, lambda: self.table.release_working(ctx, n))

    @precondition(lambda self: self.hist)
    @rule(i=IDX, tokens=st.lists(st.integers(0, 1), max_size=5), salt=SALTS, shift=st.sampled_from([0, 1, -1, -9]))
    def record(self, i, tokens, salt, shift):
        """Positions usually continue the sequence; a shift leaves a gap or goes back (then commits may fail)."""
        self.do_record(self.pick(i), tokens, salt, shift)

    @precondition(lambda self: self.hist)
    @rule(i=IDX, n=st.integers(0, 3))
    def commit(self, i, n):
        self.do_commit(self.pick(i), n)

    @precondition(lambda self: self.hist)
    @rule(i=IDX, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6), salt=SALTS)
    def fill(self, i, tokens, salt):
        self.do_fill(self.pick(i), tokens, salt)

    @precondition(lambda self: self.hist)
    @rule(i=IDX, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6), salt=SALTS)
    def fork_and_fill_both(self, i, tokens, salt):
        """Two contexts with one history committing the same tokens: the second commit must dedup."""
        ctx = self.pick(i)
        child = self.do_fork(ctx)
        if child is not None:
            self.do_fill(ctx, tokens, salt)
            self.do_fill(child, tokens, salt)

    def do_record(self, ctx, tokens, salt, shift=0):
        v = self.table.view(ctx)
        start = max(0, v.seq_len + shift)
        positions = list(range(start, start + len(tokens)))
        room = v.working_pages * PS - v.working_tokens
        ok, _ = self.attempt(len(tokens) <= room, lambda: self.table.record(ctx, tokens, positions, salt=salt))
        if ok:  # the forward pass wrote these slots
            for j, (t, p) in enumerate(zip(tokens, positions, strict=True)):
                slot = v.seq_len + j
                self.kv[v.page_ids[slot // PS]][slot % PS] = (t, p, salt)
                self.hist[ctx].append((t, p, salt))

    def do_commit(self, ctx, n):
        v = self.table.view(ctx)
        h = self.hist[ctx]
        ok = n * PS <= v.working_tokens
        top = max((p for _, p, _ in h[: v.committed_pages * PS]), default=-1)
        for j in range(n if ok else 0):
            page = [p for _, p, _ in h[(v.committed_pages + j) * PS : (v.committed_pages + j + 1) * PS]]
            ok = ok and min(page) > top
            top = max(top, *page)
        self.attempt(ok, lambda: self.table.commit(ctx, n))

    def do_fill(self, ctx, tokens, salt):
        """The SDK's common path: reserve what the tokens need, forward them, commit the full pages."""
        v = self.table.view(ctx)
        need = max(0, pages_for(v.working_tokens + len(tokens), PS) - v.working_pages)
        ok, _ = self.attempt(need <= self.avail(), lambda: self.table.reserve(ctx, need))
        if ok:
            self.do_record(ctx, tokens, salt)
            self.do_commit(ctx, self.table.view(ctx).working_tokens // PS)

    def do_fork(self, ctx):
        ok, result = self.attempt(self.table.view(ctx).working_pages <= self.avail(), lambda: self.table.fork(ctx))
        if not ok:
            return None
        child, copies = result
        self.run_copies(copies)
        self.hist[child] = list(self.hist[ctx])
        return child

    @precondition(lambda self: self.hist)
    @rule(i=IDX, n=st.integers(0, 4))
    def truncate(self, i, n):
        ctx = self.pick(i)
        ok, _ = self.attempt(n <= self.table.view(ctx).working_tokens, lambda: self.table.truncate(ctx, n))
        if ok and n:
            del self.hist[ctx][-n:]

    @precondition(lambda self: self.hist)
    @rule(i=IDX)
    def fork(self, i):
        self.do_fork(self.pick(i))

    @precondition(lambda self: self.hist)
    @rule(i=IDX, name=NAMES)
    def save(self, i, name):
        ctx = self.pick(i)
        owner = self.table.owner_of(ctx)
        need = pages_for(self.table.view(ctx).working_tokens, PS)
        ok, copies = self.attempt(
            (owner, name) not in self.snaps and need <= self.avail(), lambda: self.table.save(ctx, name)
        )
        if ok:
            self.run_copies(copies)
            self.snaps[owner, name] = list(self.hist[ctx])

    @precondition(lambda self: self.hist)
    @rule(i=IDX)
    def snapshot(self, i):
        ctx = self.pick(i)
        need = pages_for(self.table.view(ctx).working_tokens, PS)
        ok, result = self.attempt(need <= self.avail(), lambda: self.table.snapshot(ctx))
        if ok:
            name, copies = result
            self.run_copies(copies)
            self.snaps[self.table.owner_of(ctx), name] = list(self.hist[ctx])

    @rule(owner=OWNERS, name=NAMES)
    def open(self, owner, name):
        if (owner, name) not in self.snaps:
            assert self.table.open(owner, name) is None
            return
        need = self.table.view_snapshot(owner, name).working_pages
        ok, result = self.attempt(need <= self.avail(), lambda: self.table.open(owner, name))
        if ok:
            ctx, copies = result
            self.run_copies(copies)
            self.hist[ctx] = list(self.snaps[owner, name])

    @rule(owner=OWNERS, name=NAMES)
    def take(self, owner, name):
        ctx = self.table.take(owner, name)
        assert (ctx is None) == ((owner, name) not in self.snaps)
        if ctx is not None:
            self.hist[ctx] = self.snaps.pop((owner, name))

    @precondition(lambda self: self.snaps)
    @rule(owner=OWNERS, name=NAMES)
    def delete(self, owner, name):
        ok, _ = self.attempt((owner, name) in self.snaps, lambda: self.table.delete(owner, name))
        if ok:
            del self.snaps[owner, name]

    @precondition(lambda self: self.hist)
    @rule(i=IDX)
    def destroy(self, i):
        ctx = self.pick(i)
        self.table.destroy(ctx)
        self.gone.append(self.hist.pop(ctx))
        self.dead.append(ctx)

    @precondition(lambda self: self.dead)
    @rule(i=IDX)
    def destroy_again(self, i):
        self.attempt(False, lambda: self.table.destroy(self.dead[i % len(self.dead)]))

    @rule(owner=OWNERS, instance=st.sampled_from([None, "i1"]))
    def destroy_all(self, owner, instance):
        mine = set(self.table.contexts_of(owner, instance))
        assert self.table.destroy_all(owner, instance) == len(mine)
        for ctx in mine:
            self.gone.append(self.hist.pop(ctx))
            self.dead.append(ctx)

    @precondition(lambda self: self.hist)
    @rule(i=IDX, tokens=st.lists(st.integers(0, 1), max_size=8), salt=SALTS)
    def reuse_prefix(self, i, tokens, salt):
        ctx = self.pick(i)
        v = self.table.view(ctx)
        positions = list(range(v.seq_len, v.seq_len + len(tokens)))
        ok, n = self.attempt(v.working_tokens == 0, lambda: self.table.reuse_prefix(ctx, tokens, positions, salt=salt))
        if ok:
            assert n % PS == 0
            self.hist[ctx].extend(zip(tokens[:n], positions[:n], [salt] * n, strict=True))

    @precondition(lambda self: self.hist)
    @rule(i=IDX, owner=OWNERS, gone=st.booleans())
    def reuse_history(self, i, owner, gone):
        """A new context asks for the history of another context (live or destroyed), as a repeated prompt would."""
        h = self.gone[i % len(self.gone)] if gone and self.gone else self.hist[self.pick(i)]
        if not h:
            return
        tokens, positions, salt = [t for t, _, _ in h], [p for _, p, _ in h], h[0][2]
        ctx = self.table.create(owner)
        n = self.table.reuse_prefix(ctx, tokens, positions, salt=salt)
        self.hist[ctx] = list(zip(tokens[:n], positions[:n], [salt] * n, strict=True))

    # -- invariants --

    @invariant()
    def pages_are_accounted_for(self):
        s = self.store.stats()
        assert s.free + s.working + s.committed + s.cached == s.total == NP
        nodes = list(self.store.nodes())
        by_page = {n.page_id: n for n in nodes}
        holders = {}  # node page -> chains ending there
        owned: list[int] = []
        views = [self.table.view(c) for c in self.hist] + [self.table.view_snapshot(*k) for k in self.snaps]
        histories = [self.hist[c] for c in self.hist] + [self.snaps[k] for k in self.snaps]
        for v, h in zip(views, histories, strict=True):
            committed, working = v.page_ids[: v.committed_pages], v.page_ids[v.committed_pages :]
            owned.extend(working)
            if committed:
                holders[committed[-1]] = holders.get(committed[-1], 0) + 1
                walk, up = [], by_page[committed[-1]]
                while up is not None:
                    walk.append(up.page_id)
                    up = up.parent
                assert tuple(reversed(walk)) == committed
            # every slot of the context reads back exactly its own history
            assert v.seq_len == v.kv_len == len(h)
            assert [self.kv[v.page_ids[s // PS]][s % PS] for s in range(v.seq_len)] == h
        # no physical page has two owners; all pages are somewhere
        free = self.store.free_page_ids()
        assert len(owned) == len(set(owned)) == s.working
        assert len(set(owned) | set(by_page) | set(free)) == NP == len(owned) + len(by_page) + len(free)
        # refs = chains ending at the node + children; cached = nodes with no chain ending in their subtree
        for n in nodes:
            assert n.refs == holders.get(n.page_id, 0) + len(n.children)

        def pinned(n) -> bool:
            return holders.get(n.page_id, 0) > 0 or any(pinned(c) for c in n.children.values())

        assert s.cached == sum(not pinned(n) for n in nodes)
        for c in self.hist:
            v = self.table.view(c)
            assert self.table.lineage(c) == [(t, p) for t, p, _ in self.hist[c][v.committed_pages * PS :]]

    def teardown(self):
        for ctx in list(self.hist):
            self.table.destroy(ctx)
        for key in list(self.snaps):
            self.table.delete(*key)
        s = self.store.stats()
        assert s.working == 0 and s.committed == 0 and s.free + s.cached == NP
        assert len(self.store.allocate(NP)) == NP


ContextMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestContextMachine = ContextMachine.TestCase
