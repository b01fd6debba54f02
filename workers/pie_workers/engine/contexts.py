"""The contexts and snapshots of one replica, by id and by (owner, name): the engine's handle on its KV pages.

A context is a :class:`~pie_workers.engine.holding.Holding` with an id, its owner (the user) and the inferlet run
that made it; a snapshot is a holding kept under a name in its owner's namespace, outliving the run. The table
creates, forks, saves, opens and destroys them, records the tokens a forward pass wrote, and answers what a forward
pass, the residency manager and the market read from them. A snapshot whose lineage the cluster's directory also
keeps (``mirrored``) may be let go of when memory is short, least recently used first: its name lives on there, and
the next open recomputes it (adopting its prefix pages while they are still cached). A snapshot whose KV cannot be
recomputed (written under a custom attention mask, an adapter or a zo seed: ``salted``) is let go of too, after
those, the user holding the most such pages first: snapshots are idle by nature and bid nothing, so none may pin
the pool; its name stays, and opening it says what became of it.

Every operation validates before it mutates: an error leaves pages, references and lineage exactly as they were.
"""

from __future__ import annotations

import secrets
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from pie_workers.engine.holding import ContextView, Holding, PageCopies, as_bytes
from pie_workers.engine.page_store import PageStore
from pie_workers.wire.pages import pages_for


class ContextError(ValueError):
    """A context operation the context's state does not allow; the message names the context and the problem."""


@dataclass(frozen=True, slots=True)
class TableStats:
    contexts: int
    snapshots: int
    context_working_pages: int
    snapshot_working_pages: int
    working_tokens: int


@dataclass(slots=True, eq=False)
class _Context(Holding):
    id: int = 0
    instance: str | None = None


@dataclass(slots=True, eq=False)
class _Snapshot(Holding):
    mirrored: bool = False  # its lineage is in the cluster's directory: this copy may be let go of
    salted: bool = False  # its KV cannot be recomputed: once let go of, it is gone

    def pages(self, store: PageStore) -> int:
        """Pages it holds: its committed chain's and its own working ones."""
        return len(store.chain(self.tail)) + len(self.working)


class ContextTable:
    def __init__(self, store: PageStore):
        self.store = store
        self.page_size = store.page_size
        self._contexts: dict[int, _Context] = {}
        self._snapshots: OrderedDict[tuple[str, str], _Snapshot] = OrderedDict()  # least recently used first
        self._let_go: set[tuple[str, str]] = set()  # salted snapshots let go of: their names, until deleted
        self._next_id = 1

    # -- lifetime -----------------------------------------------------------------------------------------------

    def create(self, owner: str, instance: str | None = None, namespace: bytes = b"") -> int:
        """A new empty context. ``instance`` (the inferlet run) scopes ``destroy_all``; snapshots are per owner;
        ``namespace``: whose cached pages it may find and share (``page_store.namespace_key``)."""
        return self._add(Holding(owner, namespace=namespace), owner, instance)

    def destroy(self, ctx: int) -> None:
        self._contexts.pop(self._get(ctx).id).drop(self.store)

    def contexts_of(self, owner: str, instance: str | None = None) -> list[int]:
        """Live contexts of ``owner`` (only those of ``instance`` when given)."""
        return [c.id for c in self._contexts.values() if c.owner == owner and instance in (None, c.instance)]

    def destroy_all(self, owner: str, instance: str | None = None) -> int:
        """Destroy what an ended inferlet left behind; snapshots survive (they are meant to outlive contexts)."""
        ids = self.contexts_of(owner, instance)
        for ctx in ids:
            self.destroy(ctx)
        return len(ids)

    def owner_of(self, ctx: int) -> str:
        return self._get(ctx).owner

    def namespace_of(self, ctx: int) -> bytes:
        return self._get(ctx).namespace

    def snapshot_namespace(self, owner: str, name: str) -> bytes:
        return self._snapshots[owner, name].namespace

    # -- pages and tokens ---------------------------------------------------------------------------------------

    def reserve(self, ctx: int, n: int) -> list[int]:
        """Append n working pages (OutOfPages if the pool cannot supply them)."""
        c = self._get(ctx)
        self._check_count(n, "reserve", "pages", c)
        pages = self.store.allocate(n)
        c.working.extend(pages)
        return pages

    def release_working(self, ctx: int, n: int) -> None:
        """Give back the last n working pages; only pages holding no lineage tokens can go."""
        c = self._get(ctx)
        self._check_count(n, "release", "working pages", c)
        empty = len(c.working) - pages_for(len(c.lineage), self.page_size)
        if n > empty:
            raise ContextError(
                f"cannot release {n} working pages of context {c.id}: only {empty} of its {len(c.working)} "
                "working pages hold no tokens"
            )
        if n:
            pages = c.working[-n:]
            del c.working[-n:]
            self.store.free(pages)

    def record(self, ctx: int, tokens: Sequence[int], positions: Sequence[int], salt: bytes | str = b"") -> None:
        """Append lineage for tokens whose KV a completed forward pass wrote into the working pages."""
        c = self._get(ctx)
        if len(tokens) != len(positions):
            raise ContextError(
                f"cannot record into context {c.id}: {len(tokens)} tokens but {len(positions)} positions"
            )
        room = len(c.working) * self.page_size - len(c.lineage)
        if len(tokens) > room:
            raise ContextError(
                f"cannot record {len(tokens)} tokens into context {c.id}: its {len(c.working)} working pages "
                f"have room for {room} more tokens"
            )
        if len(tokens) == 1:  # a decode step
            c.lineage.append((int(tokens[0]), int(positions[0]), as_bytes(salt)))
        else:
            c.lineage.extend(zip(map(int, tokens), map(int, positions), repeat(as_bytes(salt)), strict=False))

    def truncate(self, ctx: int, n: int) -> None:
        """Drop the last n lineage tokens (speculative rollback); their pages stay reserved."""
        c = self._get(ctx)
        self._check_count(n, "truncate", "tokens", c)
        if n > len(c.lineage):
            raise ContextError(
                f"cannot truncate {n} tokens from context {c.id}: only {len(c.lineage)} tokens are in its working "
                "pages (committed pages cannot be truncated)"
            )
        if n:
            del c.lineage[-n:]

    def commit(self, ctx: int, n_pages: int) -> None:
        """Move the first n full working pages into the committed chain, sharing any identical page already there."""
        c = self._get(ctx)
        self._check_count(n_pages, "commit", "pages", c)
        size = self.page_size
        if n_pages * size > len(c.lineage):
            raise ContextError(
                f"cannot commit {n_pages} pages of context {c.id}: that needs {n_pages * size} working tokens, "
                f"it has {len(c.lineage)}"
            )
        top = -1 if c.tail is None else c.tail.max_position
        for i in range(n_pages):
            positions = [p for _, p, _ in c.lineage[i * size : (i + 1) * size]]
            if min(positions) <= top:
                raise ContextError(
                    f"cannot commit page {i} of context {c.id}: position {min(positions)} is not greater than the "
                    f"highest committed position {top}"
                )
            top = max(positions)
        c.commit(self.store, n_pages)

    def reuse_prefix(self, ctx: int, tokens: Sequence[int], positions: Sequence[int], salt: bytes | str = b"") -> int:
        """Extend the committed chain with cached pages matching the start of ``tokens``; returns tokens covered.

        The caller then only needs to forward ``tokens[returned:]``. Needs a context with no working tokens, since
        committed pages must precede them.
        """
        c = self._get(ctx)
        if c.lineage:
            raise ContextError(
                f"cannot reuse a cached prefix in context {c.id}: it has {len(c.lineage)} working tokens that "
                "would have to come after it"
            )
        if len(tokens) != len(positions):
            raise ContextError(f"cannot match context {c.id}: {len(tokens)} tokens but {len(positions)} positions")
        node, matched = self.store.match_prefix(tokens, positions, as_bytes(salt), c.tail, c.namespace)
        if matched:
            c.extend_chain(self.store, node)
        return matched * self.page_size

    # -- fork and snapshots -------------------------------------------------------------------------------------

    def fork(self, ctx: int) -> tuple[int, PageCopies]:
        """A child sharing the committed chain, with as many fresh working pages and copies of those holding tokens."""
        c = self._get(ctx)
        child, copies = c.clone(self.store, len(c.working))
        return self._add(child, c.owner, c.instance), copies

    def save(self, ctx: int, name: str) -> PageCopies:
        """Store a snapshot of the context under ``name`` in its owner's namespace (keeps only pages with tokens)."""
        c = self._get(ctx)
        self._check_free(c.owner, name)
        snap, copies = c.clone(self.store, pages_for(len(c.lineage), self.page_size))
        self._snapshots[c.owner, name] = _Snapshot(
            snap.owner, snap.tail, snap.working, snap.lineage, snap.namespace, salted=not snap.recomputable()
        )
        return copies

    def keep(self, ctx: int, name: str) -> None:
        """The context becomes snapshot ``name``: its pages that hold tokens change hands, nothing is copied, and
        the context ends (the rest of its working pages are freed)."""
        c = self._get(ctx)
        self._check_free(c.owner, name)
        del self._contexts[ctx]
        used = pages_for(len(c.lineage), self.page_size)
        self.store.free(c.working[used:])
        self._snapshots[c.owner, name] = _Snapshot(
            c.owner, c.tail, c.working[:used], c.lineage, c.namespace, salted=not c.recomputable()
        )

    def mirrored(self, owner: str, name: str) -> None:
        """The directory now keeps the snapshot's lineage: this replica may let go of its pages."""
        self._snapshots[owner, name].mirrored = True

    def let_go_of_snapshot(self) -> bool:
        """Drop the least recently used mirrored snapshot's pages here (its name and lineage stay in the
        directory), else a salted one of the user whose salted snapshots hold the most pages (its name stays, as
        one let go of); False if there is none."""
        key = next((key for key, snap in self._snapshots.items() if snap.mirrored), None)
        if key is None:
            held: Counter[str] = Counter()
            for (owner, _), snap in self._snapshots.items():
                if snap.salted:
                    held[owner] += snap.pages(self.store)
            if not held:
                return False
            heaviest = held.most_common(1)[0][0]
            key = next(key for key, snap in self._snapshots.items() if snap.salted and key[0] == heaviest)
            self._let_go.add(key)
        self._snapshots.pop(key).drop(self.store)
        return True

    def check_not_let_go(self, owner: str, name: str) -> None:
        """A ContextError if the snapshot was salted and let go of when memory ran short."""
        if (owner, name) in self._let_go:
            raise ContextError(
                f"snapshot {name!r} of user {owner!r} was let go of when this replica's memory ran short: it was "
                "written under a custom attention mask, an adapter or a zo seed, so it cannot be recomputed "
                "(delete the name to reuse it)"
            )

    def snapshot_usage(self, owner: str) -> tuple[int, int]:
        """The owner's snapshots here (names let go of included), and the pages held by those the directory cannot
        recompute (a mirrored one gives its pages back, at no loss, to whoever needs them)."""
        mine = [snap for (o, _), snap in self._snapshots.items() if o == owner]
        gone = sum(1 for o, _ in self._let_go if o == owner)
        return len(mine) + gone, sum(snap.pages(self.store) for snap in mine if not snap.mirrored)

    def snapshot(self, ctx: int) -> tuple[str, PageCopies]:
        """Like ``save`` with a generated name, unique among the owner's snapshots."""
        owner = self._get(ctx).owner
        name = f"snapshot-{secrets.token_hex(8)}"
        while (owner, name) in self._snapshots or (owner, name) in self._let_go:
            name = f"snapshot-{secrets.token_hex(8)}"
        return name, self.save(ctx, name)

    def open(self, owner: str, name: str, instance: str | None = None) -> tuple[int, PageCopies] | None:
        """A new context forked from the snapshot (which stays); None if the owner has no such snapshot."""
        snap = self._snapshots.get((owner, name))
        if snap is None:
            return None
        child, copies = snap.clone(self.store, len(snap.working))
        self._snapshots.move_to_end((owner, name))
        return self._add(child, owner, instance), copies

    def take(self, owner: str, name: str, instance: str | None = None) -> int | None:
        """The snapshot becomes a context: its pages change hands, nothing is copied. None if absent."""
        snap = self._snapshots.pop((owner, name), None)
        return None if snap is None else self._add(snap, owner, instance)

    def delete(self, owner: str, name: str) -> None:
        if (owner, name) in self._let_go:
            self._let_go.discard((owner, name))
            return
        snap = self._snapshots.pop((owner, name), None)
        if snap is None:
            raise ContextError(f"no snapshot named {name!r} for user {owner!r}")
        snap.drop(self.store)

    def snapshots_of(self, owner: str) -> list[str]:
        return sorted(name for o, name in self._snapshots if o == owner)

    # -- reading ------------------------------------------------------------------------------------------------

    def view(self, ctx: int) -> ContextView:
        return self._get(ctx).view(self.store)

    def seq_len(self, ctx: int) -> int:
        """Tokens whose KV the context holds (``view(ctx).seq_len`` without building the view)."""
        c = self._get(ctx)
        return (0 if c.tail is None else c.tail.depth) * self.page_size + len(c.lineage)

    def view_snapshot(self, owner: str, name: str) -> ContextView:
        snap = self._snapshots.get((owner, name))
        if snap is None:
            raise ContextError(f"no snapshot named {name!r} for user {owner!r}")
        return snap.view(self.store)

    def tokens(self, ctx: int) -> list[int]:
        """Every token whose KV the context holds, in order: the committed chain's, then the working ones."""
        c = self._get(ctx)
        return [t for node in c.chain_nodes() for t in node.tokens] + [t for t, _, _ in c.lineage]

    def recomputable(self, ctx: int) -> bool:
        """Whether plain causal forward passes over the context's tokens rebuild its KV exactly: nothing in it was
        written under a salt (custom attention mask, adapter, zo seed)."""
        return self._get(ctx).recomputable()

    def text(self, ctx: int) -> tuple[list[tuple[int, int]], int]:
        """(token, position) of every token of the context, and how many of them are committed."""
        return self._get(ctx).text()

    def text_from(self, ctx: int, start: int) -> tuple[list[int], list[int]]:
        """Tokens and positions of the context from index ``start`` on."""
        return self._get(ctx).text_from(self.store, start)

    def snapshot_text(self, owner: str, name: str) -> tuple[list[tuple[int, int]], int] | None:
        """Like ``text`` for a snapshot; None if it is absent or its KV could not be recomputed."""
        snap = self._snapshots.get((owner, name))
        return None if snap is None or not snap.recomputable() else snap.text()

    def holds_pages(self, ctx: int) -> bool:
        c = self._get(ctx)
        return bool(c.working) or c.tail is not None

    def evict(self, ctx: int) -> tuple[list[tuple[int, int]], int]:
        """Give up every page of the context, keeping what recomputes it: (token, position) of each of its tokens,
        and how many of them were committed. The context stays, empty, until refilled (``reuse_prefix``, forward)."""
        c = self._get(ctx)
        text, committed = c.text()
        c.drop(self.store)
        c.tail, c.working, c.lineage = None, [], []
        return text, committed

    def effective_pages(self, ids: Sequence[int]) -> list[float]:
        """Per context: its working pages plus its Shapley share of committed ones (each shared page split evenly
        among the contexts and snapshots holding it). What the market charges rent on."""
        shares = self.store.chain_shares()
        return [
            len(c.working) + (shares[c.tail] if c.tail is not None else 0.0) for c in (self._get(ctx) for ctx in ids)
        ]

    def ids(self) -> list[int]:
        return list(self._contexts)

    def holding(self, ctx: int) -> Holding:
        """The context's holding itself, which a handover reads whole (``transfer.py``)."""
        return self._get(ctx)

    def snapshot_holdings(self) -> list[tuple[str, str, Holding]]:
        return [(owner, name, snap) for (owner, name), snap in self._snapshots.items()]

    def stats(self) -> TableStats:
        return TableStats(
            contexts=len(self._contexts),
            snapshots=len(self._snapshots),
            context_working_pages=sum(len(c.working) for c in self._contexts.values()),
            snapshot_working_pages=sum(len(s.working) for s in self._snapshots.values()),
            working_tokens=sum(len(c.lineage) for c in self._contexts.values()),
        )

    # -- internals ----------------------------------------------------------------------------------------------

    def _get(self, ctx: int) -> _Context:
        c = self._contexts.get(ctx)
        if c is not None:
            return c
        if isinstance(ctx, int) and 0 < ctx < self._next_id:
            raise ContextError(f"context {ctx} was destroyed")
        raise ContextError(f"unknown context id {ctx!r}")

    def _add(self, holding: Holding, owner: str, instance: str | None) -> int:
        ctx = _Context(
            owner, holding.tail, holding.working, holding.lineage, holding.namespace, self._next_id, instance
        )
        self._contexts[ctx.id] = ctx
        self._next_id += 1
        return ctx.id

    def _check_free(self, owner: str, name: str) -> None:
        if not name:
            raise ContextError("a snapshot name cannot be empty")
        if (owner, name) in self._snapshots or (owner, name) in self._let_go:
            raise ContextError(f"snapshot {name!r} already exists for user {owner!r}")

    @staticmethod
    def _check_count(n: int, verb: str, what: str, c: _Context) -> None:
        if n < 0:
            raise ContextError(f"cannot {verb} a negative number of {what} ({n}) in context {c.id}")
