"""Physical KV pages of one replica: a free list plus a content-addressed prefix trie of committed pages.

A committed page is keyed by everything that determined its KV (the chain before it, its tokens, their positions,
and a salt for adapter / seed / attention-mask state), so identical prefixes share one physical page, and a prefix
nobody holds any more stays cached until its page is needed. Who may find it is part of the key too: a chain's
first page hangs below its holder's namespace (``namespace_key``: the verified user and the request's own cache
salt), so one tenant's lookups never reach another's pages and a hit tells nobody what another user sent.
Reference counts make forking O(1): a fork retains the tail of the shared chain instead of copying it.

Counting rule: ``node.refs`` = chains that end at the node (contexts, snapshots) + the node's children. A node with
``refs == 0`` is an unreferenced leaf, evicted least recently used first. A node is *pinned* while some chain ends in
its subtree; an unpinned node is cache: it goes once the leaves below it have gone. Counting unpinned nodes lets
``allocate`` fail before evicting anything rather than after.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class OutOfPages(RuntimeError):
    """The pool cannot supply the pages asked for, even after evicting every cached page."""

    def __init__(self, requested: int, available: int, total: int):
        super().__init__(
            f"out of KV pages: asked for {requested}, but only {available} of the pool's {total} pages can be had "
            "(free or prefix cache); the rest are held by contexts and snapshots"
        )
        self.requested, self.available, self.total = requested, available, total

    def __reduce__(self):  # keep it picklable (Ray ships exceptions between processes)
        return OutOfPages, (self.requested, self.available, self.total)


def namespace_key(user: str | None, cache_salt: str = "") -> bytes:
    """The key a chain's first page hangs below: pages are found only by lookups under the same namespace. ``user``
    None (the operator shares prefixes cluster-wide) and no salt gives the empty key every such lookup shares."""
    if user is None and not cache_salt:
        return b""
    h = hashlib.blake2b(digest_size=16, person=b"pie-namespace")
    for part in (b"" if user is None else b"u" + user.encode(), cache_salt.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def page_key(parent_key: bytes, tokens: Sequence[int], positions: Sequence[int], salt: bytes | str = b"") -> bytes:
    """Content address of a committed page; chaining the parent's key makes it address the whole prefix."""
    salt = salt.encode() if isinstance(salt, str) else bytes(salt)
    h = hashlib.blake2b(digest_size=16)
    for part in (parent_key, salt):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(array("q", positions).tobytes())
    return h.digest()


class Node:
    """One committed page. Its key, page, content, parent and position are fixed; only the bookkeeping fields change.

    The content (tokens, positions, salt) is kept so a context's whole text can be read back: the n-gram drafter
    searches it, and a suspended context is recomputed from it.
    """

    __slots__ = (
        "key",
        "tokens",
        "positions",
        "salt",
        "page_id",
        "parent",
        "children",
        "refs",
        "last_used",
        "depth",
        "max_position",
        "_pinned_kids",
        "_chain",
    )

    def __init__(
        self, key: bytes, page_id: int, parent: Node | None, tokens: tuple[int, ...], positions: tuple[int, ...], salt
    ):
        self.key, self.page_id, self.parent = key, page_id, parent
        self.tokens, self.positions, self.salt = tokens, positions, salt
        max_position = max(positions)
        self.children: dict[bytes, Node] = {}
        self.refs = 0
        self.last_used = 0
        self.depth = 1 if parent is None else parent.depth + 1
        self.max_position = max_position if parent is None else max(max_position, parent.max_position)
        self._pinned_kids = 0  # children whose subtree some chain ends in
        self._chain: tuple[int, ...] | None = None

    @property
    def ends(self) -> int:
        """Chains (contexts, snapshots) that end at this node."""
        return self.refs - len(self.children)

    @property
    def pinned(self) -> bool:
        return self.ends > 0 or self._pinned_kids > 0

    def __repr__(self) -> str:
        return f"Node(page={self.page_id}, depth={self.depth}, refs={self.refs})"


@dataclass(frozen=True, slots=True)
class PageStats:
    """Where every page is; ``free + working + committed + cached == total`` always holds.

    ``committed`` trie pages are part of some context's or snapshot's chain; ``cached`` ones are not (unreferenced
    leaves and the prefixes above them) and are evicted on demand, so ``free + cached`` pages can be allocated now.
    """

    total: int
    free: int
    working: int
    committed: int
    cached: int


class PageStore:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a page store needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._working: set[int] = set()
        self._roots: dict[bytes, Node] = {}
        self._num_nodes = 0
        self._num_pinned = 0
        self._leaves: set[Node] = set()  # unreferenced leaves: the ones eviction may take next
        self._lru: list[tuple[int, int, Node]] = []  # (last_used, tiebreak, node); stale entries skipped lazily
        self._tiebreak = itertools.count()
        self._clock = 0  # logical time of the last touch

    # -- working pages ------------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Hand out n working pages, evicting least recently used cache if the free list is short."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        short = n - len(self._free)
        if short > 0:
            cached = self._num_nodes - self._num_pinned
            if short > cached:
                raise OutOfPages(n, len(self._free) + cached, self.num_pages)
            for _ in range(short):
                self._evict_one()
        pages = [self._free.pop() for _ in range(n)]
        self._working.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return working pages to the free list (committed pages go through ``release`` instead)."""
        bad = [p for p in pages if p not in self._working]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"cannot free pages {sorted(bad) or list(pages)}: not distinct allocated working pages")
        self._working.difference_update(pages)
        self._free.extend(pages)

    # -- the trie -----------------------------------------------------------------------------------------------

    def commit(
        self,
        parent: Node | None,
        page_id: int,
        tokens: Sequence[int],
        positions: Sequence[int],
        salt: bytes | str = b"",
        namespace: bytes = b"",
    ) -> tuple[Node, bool]:
        """Make working page ``page_id`` (full with ``tokens``) the child of ``parent`` (None: a first page, below
        ``namespace``).

        Returns the node, retained once for the caller (whose chain now ends there), and whether the caller's page
        was kept: if an identical page already exists under ``parent`` the caller's copy is freed and the existing
        node is shared.
        """
        if page_id not in self._working:
            raise ValueError(f"cannot commit page {page_id}: it is not an allocated working page")
        if len(tokens) != self.page_size or len(positions) != self.page_size:
            raise ValueError(
                f"a committed page holds exactly {self.page_size} tokens and positions, "
                f"got {len(tokens)} and {len(positions)}"
            )
        key = page_key(namespace if parent is None else parent.key, tokens, positions, salt)
        siblings = self._roots if parent is None else parent.children
        self._working.discard(page_id)
        node = siblings.get(key)
        if node is not None:
            self._free.append(page_id)
            self.retain(node)
            return node, False
        node = Node(
            key,
            page_id,
            parent,
            tuple(tokens),
            tuple(positions),
            salt.encode() if isinstance(salt, str) else bytes(salt),
        )
        if parent is not None:
            self._ref(parent)
        siblings[key] = node
        self._num_nodes += 1
        self.retain(node)
        return node, True

    def retain(self, node: Node) -> None:
        """One more chain ends at ``node`` (a fork, a snapshot, a context adopting a cached prefix)."""
        was_pinned = node.pinned
        self._ref(node)
        self._touch(node)
        if not was_pinned:
            self._pin(node)

    def release(self, node: Node) -> None:
        """A chain that ended at ``node`` is gone; what no chain needs any more stays behind as cache."""
        if node.ends <= 0:
            raise ValueError(f"cannot release {node!r}: no chain ends at it")
        self._touch(node)
        self._unref(node)
        if node.ends == 0:
            node._chain = None  # only chain ends keep their page list cached (bounds memory on long chains)
            if node._pinned_kids == 0:
                self._unpin(node)

    def match_prefix(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        salt: bytes | str = b"",
        parent: Node | None = None,
        namespace: bytes = b"",
    ) -> tuple[Node | None, int]:
        """Longest run of full pages of ``tokens`` already in the trie below ``parent`` (None: from the first page,
        of ``namespace``): (deepest node, pages).

        Matched nodes count as used (for LRU) but are not retained: retain the result before allocating.
        With no match the result is ``(parent, 0)``.
        """
        if len(tokens) != len(positions):
            raise ValueError(f"{len(tokens)} tokens but {len(positions)} positions")
        size, node, matched = self.page_size, parent, 0
        for start in range(0, len(tokens) - size + 1, size):
            key = page_key(
                namespace if node is None else node.key,
                tokens[start : start + size],
                positions[start : start + size],
                salt,
            )
            child = (self._roots if node is None else node.children).get(key)
            if child is None:
                break
            self._touch(child)
            node, matched = child, matched + 1
        return node, matched

    def chain(self, node: Node | None) -> tuple[int, ...]:
        """Physical page ids root → ``node``; cached on nodes that chains end at."""
        if node is None:
            return ()
        if node._chain is not None:
            return node._chain
        path, up = [], node
        while up is not None and up._chain is None:
            path.append(up.page_id)
            up = up.parent
        chain = (() if up is None else up._chain) + tuple(reversed(path))
        if node.ends > 0:
            node._chain = chain
        return chain

    def chain_shares(self) -> dict[Node, float]:
        """For every node some chain passes through: Σ 1/(chains through it) over the nodes root → it. A chain
        ending at a node holds that many pages in Shapley terms (a page shared by h chains costs each 1/h)."""
        order = list(self.nodes())  # pre-order: parents before children
        through: dict[Node, int] = {}
        for node in reversed(order):
            n = node.ends + sum(through.get(child, 0) for child in node.children.values())
            if n:
                through[node] = n
        shares: dict[Node, float] = {}
        for node in order:
            if node in through:
                shares[node] = (0.0 if node.parent is None else shares[node.parent]) + 1.0 / through[node]
        return shares

    def nodes(self) -> Iterator[Node]:
        """Every node in the trie (pre-order)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def available(self) -> int:
        """Pages an allocation can have now: free ones plus evictable cache."""
        return len(self._free) + self._num_nodes - self._num_pinned

    def free_page_ids(self) -> list[int]:
        return list(self._free)

    def stats(self) -> PageStats:
        return PageStats(
            total=self.num_pages,
            free=len(self._free),
            working=len(self._working),
            committed=self._num_pinned,
            cached=self._num_nodes - self._num_pinned,
        )

    # -- internals ----------------------------------------------------------------------------------------------

    def _touch(self, node: Node) -> None:
        self._clock += 1
        node.last_used = self._clock
        if node in self._leaves:
            self._push_lru(node)

    def _ref(self, node: Node) -> None:
        if node.refs == 0:
            self._leaves.discard(node)
        node.refs += 1

    def _unref(self, node: Node) -> None:
        node.refs -= 1
        if node.refs == 0:
            self._leaves.add(node)
            self._push_lru(node)

    def _push_lru(self, node: Node) -> None:
        heapq.heappush(self._lru, (node.last_used, next(self._tiebreak), node))
        if len(self._lru) > 2 * len(self._leaves) + 64:  # drop stale entries left by touches and re-references
            self._lru = [(n.last_used, next(self._tiebreak), n) for n in self._leaves]
            heapq.heapify(self._lru)

    def _pin(self, node: Node | None) -> None:
        """``node`` became pinned: count it, and propagate to ancestors that were not pinned yet."""
        while node is not None:
            self._num_pinned += 1
            parent = node.parent
            if parent is None:
                return
            parent._pinned_kids += 1
            if parent.ends > 0 or parent._pinned_kids > 1:
                return
            node = parent

    def _unpin(self, node: Node | None) -> None:
        while node is not None:
            self._num_pinned -= 1
            parent = node.parent
            if parent is None:
                return
            parent._pinned_kids -= 1
            if parent.pinned:
                return
            node = parent

    def _evict_one(self) -> None:
        while True:
            last_used, _, node = heapq.heappop(self._lru)
            if node in self._leaves and node.last_used == last_used:
                break
        self._leaves.remove(node)
        parent = node.parent
        del (self._roots if parent is None else parent.children)[node.key]
        self._num_nodes -= 1
        self._free.append(node.page_id)
        if parent is not None:
            self._unref(parent)
