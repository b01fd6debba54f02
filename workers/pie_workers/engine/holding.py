"""What a context or a snapshot holds: a committed chain in the page store's trie plus working pages of its own.

The chain is shared, content-addressed and immutable; the holding keeps one reference on its tail node. The
working pages belong to the holding alone, and its lineage records, in order, the tokens whose KV a forward pass
has written into them. Commit moves full working pages into the trie; clone shares the chain by reference and
copies only the working pages that hold tokens (the returned ``(src, dst)`` copies must run before the next forward).

``ContextTable`` (contexts.py) names holdings and validates every request before calling the operations here, which
assume a valid request and keep the store's references and pages balanced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import NamedTuple

from pie_workers.engine.page_store import Node, PageStore
from pie_workers.wire.pages import pages_for

PageCopies = list[tuple[int, int]]


class ContextView(NamedTuple):
    """What a forward pass needs: every page of the context (committed chain, then working) and its KV length.
    A named tuple: the engine builds several per forward, and a frozen dataclass costs four times as much."""

    page_ids: tuple[int, ...]
    kv_len: int
    seq_len: int
    committed_pages: int
    working_pages: int
    working_tokens: int
    page_size: int


def page_salt(salts: list[bytes]) -> bytes:
    """A page whose tokens share one salt hashes with that salt (so ``match_prefix`` with it finds the page)."""
    if len(groups := [(s, len(list(g))) for s, g in groupby(salts)]) == 1:
        return groups[0][0]
    return b"\x00mixed" + b"".join(len(s).to_bytes(4, "little") + s + n.to_bytes(4, "little") for s, n in groups)


def as_bytes(salt: bytes | str) -> bytes:
    return salt.encode() if isinstance(salt, str) else bytes(salt)


def lineage_text(tokens: list, positions: list, vocab: int) -> list[tuple[int, int]]:
    """(token, position) pairs from an inferlet's mirror of a context, refused with a message naming the problem
    unless they are token ids of this model at positions >= 0, as many of each."""
    if not isinstance(tokens, list) or not isinstance(positions, list) or len(tokens) != len(positions):
        raise ValueError("a lineage is two lists of the same length: token ids and their positions")
    for t, p in zip(tokens, positions, strict=True):
        if type(t) is not int or not 0 <= t < vocab or type(p) is not int or p < 0:
            raise ValueError(f"a lineage holds token ids below {vocab} at positions >= 0, got token {t!r} at {p!r}")
    return list(zip(tokens, positions, strict=True))


@dataclass(slots=True, eq=False)
class Holding:
    """A committed chain tail plus exclusively owned working pages: the state of a context or of a snapshot.

    Lineage entries are (token, position, salt); the salt is kept per token so a page mixing adapters or masks
    still hashes by what produced each of its tokens. ``namespace`` (``page_store.namespace_key``) is whose lookups
    may find its chain: its first page hangs below it, and a clone keeps it, so forks and snapshots share pages.
    """

    owner: str
    tail: Node | None = None
    working: list[int] = field(default_factory=list)
    lineage: list[tuple[int, int, bytes]] = field(default_factory=list)
    namespace: bytes = b""

    def commit(self, store: PageStore, n_pages: int) -> None:
        """Move the first n full working pages into the chain, sharing any identical page already in the trie."""
        size = store.page_size
        old = tail = self.tail
        for i in range(n_pages):
            entries = self.lineage[i * size : (i + 1) * size]
            node, _ = store.commit(
                tail,
                self.working[i],
                [t for t, _, _ in entries],
                [p for _, p, _ in entries],
                page_salt([s for _, _, s in entries]),
                self.namespace,
            )
            if tail is not old:
                store.release(tail)
            tail = node
        if n_pages:
            store.chain(tail)  # extend the old tail's cached page list before letting it go
            if old is not None:
                store.release(old)
        self.tail = tail
        del self.working[:n_pages]
        del self.lineage[: n_pages * size]

    def extend_chain(self, store: PageStore, node: Node) -> None:
        """Make ``node`` (a descendant of the tail, found by ``match_prefix``) the new tail."""
        store.retain(node)
        store.chain(node)
        if self.tail is not None:
            store.release(self.tail)
        self.tail = node

    def clone(self, store: PageStore, n_pages: int) -> tuple[Holding, PageCopies]:
        """Share the committed chain and copy the token-holding working pages into n_pages fresh ones."""
        pages = store.allocate(n_pages)
        if self.tail is not None:
            store.retain(self.tail)
        used = pages_for(len(self.lineage), store.page_size)
        copies = list(zip(self.working[:used], pages[:used], strict=True))
        return Holding(self.owner, self.tail, pages, list(self.lineage), self.namespace), copies

    def drop(self, store: PageStore) -> None:
        """Give back the chain reference and the working pages (the fields are left as they were)."""
        if self.tail is not None:
            store.release(self.tail)
        store.free(self.working)

    def view(self, store: PageStore) -> ContextView:
        chain = store.chain(self.tail)
        seq_len = len(chain) * store.page_size + len(self.lineage)
        return ContextView(
            chain + tuple(self.working),
            seq_len,
            seq_len,
            len(chain),
            len(self.working),
            len(self.lineage),
            store.page_size,
        )

    def text(self) -> tuple[list[tuple[int, int]], int]:
        """(token, position) of every token, committed first, and how many of them are committed."""
        text = [(t, p) for n in self.chain_nodes() for t, p in zip(n.tokens, n.positions, strict=True)]
        committed = len(text)
        return text + [(t, p) for t, p, _ in self.lineage], committed

    def text_from(self, store: PageStore, start: int) -> tuple[list[int], list[int]]:
        """Tokens and positions from index ``start`` on, reading back only the committed pages that hold them (a
        decode step's answer carries its one new token without walking a long context's chain)."""
        committed = len(store.chain(self.tail)) * store.page_size
        working = self.lineage[max(0, start - committed) :]
        tokens, positions = [t for t, _, _ in working], [p for _, p, _ in working]
        node, end = self.tail, committed
        while node is not None and end > start:
            begin = end - len(node.tokens)
            cut = max(0, start - begin)
            tokens[:0], positions[:0] = node.tokens[cut:], node.positions[cut:]
            node, end = node.parent, begin
        return tokens, positions

    def recomputable(self) -> bool:
        """Whether nothing in the holding was written under a salt (mask, adapter, zo seed)."""
        return not any(s for _, _, s in self.lineage) and not any(n.salt for n in self.chain_nodes())

    def chain_nodes(self) -> list[Node]:
        """The committed chain from its root to the tail."""
        nodes, node = [], self.tail
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]
