"""ContextTable under a stateful property test: random sequences of create, fill, fork, truncate, snapshot,
open, take, delete and destroy, by several owners, against a simulated KV pool.

The test keeps a simulated KV pool (what each physical page slot holds) and writes recorded tokens into it through
the context's page table, executing the page copies the table hands back. It then checks that every context and
snapshot reads exactly its own token history through its page ids: that is the end-to-end meaning of dedup, O(1)
fork and copy-on-fork being right. The same invariants case by case are in ``test_contexts.py``.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pie_workers.engine import ContextError, ContextTable, OutOfPages, PageStore
from pie_workers.wire.pages import pages_for

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
            working = [(t, p) for t, p, _ in self.table.holding(c).lineage]
            assert working == [(t, p) for t, p, _ in self.hist[c][v.committed_pages * PS :]]

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
