"""Who keeps KV pages when a replica's pool runs short: bids, suspension, and the order of restores.

Every context bids credits per page per tick (``set_bid``; 0 until its inferlet says otherwise), capped at what its
process can afford when the replica reports to the market (``set_caps``: a process without credits loses rank).
Allocation stays local and immediate while the pool has room and nobody is waiting. When it does not:

* A requester that is first in line (no waiter outranks it) suspends contexts bidding less than it does, and
  those bidding the same that have not been used for ``IDLE_BATCHES`` batches, lowest bid and least recently used
  first, until what it needs is available; one with a pass in flight gives its pages up when its next pass begins
  (a pass is never cut short, and a Generator's chained steps leave no moment between passes). (Equal bids
  displace only the idle: contexts generating side by side do not evict each other every step, yet one that
  finished its work but was not released blocks nobody.)
* Otherwise it waits in line, ordered by bid (highest first, first come first served among equals), after
  suspending itself if it holds pages, so a waiter never sits on memory someone ahead of it needs.
* A suspended context gives up all its pages and keeps its text. Its pages' contents move to host memory when the
  host buffer has room, else they are dropped. Its next operation waits in the same line, adopts prefix pages still
  cached, and copies the rest back from host memory or, if they were dropped, recomputes them. Nothing is lost;
  tokens come out the same.

The ordering property: a context is suspended only to make room for one bidding more per page (or as much, once it
has been idle), or by its own choice when it has to wait. So it can be suspended while a lower per-page bidder stays
resident only until that bidder's next pass begins (when it had one in flight) or when its KV cannot be recomputed
(written under a custom attention mask, an adapter or a zo seed: such contexts are never suspended). Snapshots are
never suspended.

Passes take their pages through here too (``reserve``, or ``grant`` once ``try_now`` allowed them), and every page a
context's process makes is charged to it; ``restore`` brings a suspended context back before its next operation.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pie_workers.engine.contexts import ContextError, ContextTable, ContextView
from pie_workers.engine.page_store import OutOfPages
from pie_workers.wire.pages import pages_for

IDLE_BATCHES = 4  # batches without an operation after which a context counts as idle

PagePairs = list[tuple[int, int]]


def pages_to_reserve(view: ContextView, new_tokens: int) -> int:
    """Working pages a context (as ``view`` shows it) still has to reserve to take ``new_tokens`` more tokens."""
    return pages_for(view.seq_len + new_tokens, view.page_size) - len(view.page_ids)


@dataclass
class Suspended:
    text: list[tuple[int, int]]  # (token, position) of every token the context held
    committed: int  # how many of them were committed (page-aligned)
    pages: int  # pages they need back
    host: list[int] | None = None  # host slot holding each of those pages, in order; None: recompute them


@dataclass(order=True)
class _Waiter:
    rank: tuple[float, int]  # (-bid, arrival): the line's order
    ctx: int = field(compare=False)
    pages: Callable[[], int] = field(compare=False)
    event: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class Residency:
    def __init__(
        self,
        contexts: ContextTable,
        busy: Callable[[int], bool],
        clock: Callable[[], int],
        host_pages: int = 0,
        offload: Callable[[PagePairs], None] | None = None,
        copy_in: Callable[[PagePairs], Awaitable] | None = None,
        recompute: Callable[[int, list[int], list[int], int], Awaitable] | None = None,
        forget_drafts: Callable[[int], None] = lambda ctx: None,
        made: Callable[[str, int], None] | None = None,
    ) -> None:
        """The engine's side, for suspensions and restores: ``offload(pairs)`` queues copies of (page, host slot)
        that run before any later use of those pages, ``copy_in(pairs)`` copies (host slot, page) back;
        ``recompute(ctx, tokens, positions, hold)`` rebuilds a restored context's KV for those tokens by passes
        (committing full pages but those touching the last ``hold`` tokens); ``forget_drafts(ctx)`` drops the
        context's n-gram index. ``made(process, pages)``: ``process`` made ``pages`` new pages (None: nobody
        counts them)."""
        self.contexts = contexts
        self.store = contexts.store
        self.busy = busy  # ctx -> an operation on it is in flight, so it cannot be suspended now
        self.bids: dict[int, float] = {}
        self.owners: dict[int, str] = {}  # ctx -> its process (inferlet instance), whose wallet pays its rent
        self._caps: dict[str, float] = {}  # process -> the highest bid per page it can afford; absent: no cap
        self.suspended: dict[int, Suspended] = {}
        self.deferred: set[int] = set()  # busy contexts that suspend when their next pass begins
        self._line: list[_Waiter] = []
        self._arrivals = itertools.count()
        self.suspensions = 0
        self.offloaded = 0  # suspensions whose pages went to host memory
        self._free_host = list(range(host_pages - 1, -1, -1)) if offload is not None else []
        self._offload = offload
        self._copy_in = copy_in
        self._recompute = recompute
        self._forget_drafts = forget_drafts
        self._made = made
        self._last_use: dict[int, int] = {}
        self._clock = clock  # batches fired so far

    def touch(self, ctx: int) -> None:
        """An operation used ``ctx`` now."""
        self._last_use[ctx] = self._clock()

    def bid(self, ctx: int | None) -> float:
        """The context's bid per page, capped at what its process can afford."""
        return min(self.bids.get(ctx, 0.0), self._caps.get(self.owners.get(ctx), math.inf))

    def set_caps(self, caps: dict[str, float]) -> None:
        """The market's latest word on what these processes can afford per page. A process missing from the round
        keeps its previous cap: it held no pages and wanted none, so it paid nothing since (at worst the cap is
        low by the dividends it received)."""
        self._caps.update(caps)

    def forget_process(self, process: str) -> None:
        self._caps.pop(process, None)

    def set_bid(self, ctx: int, bid: float) -> None:
        bid = float(bid)
        if not (bid >= 0.0 and math.isfinite(bid)):
            raise ValueError(f"a bid is a finite number of credits per page >= 0, got {bid!r}")
        self.bids[ctx] = bid

    def inherit(self, child: int, parent: int) -> None:
        if parent in self.bids:
            self.bids[child] = self.bids[parent]

    def forget(self, ctx: int) -> None:
        self.bids.pop(ctx, None)
        self.owners.pop(ctx, None)
        if (gone := self.suspended.pop(ctx, None)) is not None and gone.host:
            self.release_host(gone.host)
        self.deferred.discard(ctx)
        self._last_use.pop(ctx, None)

    @property
    def waiting(self) -> int:
        return len(self._line)

    def waiters(self) -> dict[int, int]:
        """Contexts waiting in line for memory, with the pages each waits for."""
        return {w.ctx: w.pages() for w in self._line}

    def suspend(self, ctx: int) -> bool:
        """Give up the context's pages, keeping its text (and their contents in host memory when there is room);
        False if its KV could not be recomputed."""
        self.deferred.discard(ctx)
        if ctx in self.suspended or not self.contexts.recomputable(ctx):
            return False
        view = self.contexts.view(ctx)
        pages = view.page_ids[: pages_for(view.seq_len, self.store.page_size)]  # the pages holding its tokens
        host = None
        if pages and len(self._free_host) >= len(pages):
            host = [self._free_host.pop() for _ in pages]
            self._offload(list(zip(pages, host, strict=True)))  # queued before anyone can reuse the pages
            self.offloaded += 1
        self.add_suspended(ctx, *self.contexts.evict(ctx))
        self.suspended[ctx].host = host
        self.suspensions += 1
        return True

    def suspend_or_defer(self, ctx: int) -> None:
        """Suspend ``ctx`` now, or, while an operation on it is in flight, when its next pass begins or the operation
        ends with none after it. A Generator chains its steps, so a generating context is never between operations:
        its step boundary is the moment."""
        if self.busy(ctx):
            self.deferred.add(ctx)
        else:
            self.suspend(ctx)

    def pass_begins(self, ctx: int) -> None:
        """A pass on ``ctx`` begins (nothing of it in a batch yet): carry out a suspension deferred until now."""
        if ctx in self.deferred:
            self.suspend(ctx)

    def release_host(self, slots: list[int]) -> None:
        self._free_host.extend(slots)

    def add_suspended(self, ctx: int, text: list[tuple[int, int]], committed: int) -> None:
        """Record ``ctx`` (holding no pages) as suspended with this text, to be recomputed on its next pass."""
        self.suspended[ctx] = Suspended(list(text), committed, pages_for(len(text), self.store.page_size))

    def truncate(self, ctx: int, n: int) -> None:
        """Truncate a suspended context's text (only its uncommitted tokens, as for a resident one)."""
        s = self.suspended[ctx]
        if not 0 <= n <= len(s.text) - s.committed:
            raise ValueError(
                f"cannot truncate {n} tokens from context {ctx}: only {len(s.text) - s.committed} of its tokens are "
                "uncommitted (committed pages cannot be truncated)"
            )
        del s.text[len(s.text) - n :]
        s.pages = pages_for(len(s.text), self.store.page_size)
        if s.host is not None:
            self.release_host(s.host[s.pages :])
            del s.host[s.pages :]

    def try_now(self, ctx: int | None, pages: int) -> bool:
        """Whether ``ctx`` may reserve ``pages`` right away: no waiter bids as much, and the pool has (or suspending
        lower bidders makes) the room."""
        if self._line and -self._line[0].rank[0] >= self.bid(ctx):
            return False
        self._make_room(ctx, pages)
        return self.store.available >= pages

    async def wait_for(self, ctx: int, pages: Callable[[], int]) -> None:
        """Return once ``pages()`` pages are available to ``ctx`` and no waiter outranks it; suspends lower bidders
        on the way. The caller reserves them before its next await."""
        if pages() > self.store.num_pages:
            raise OutOfPages(pages(), self.store.available, self.store.num_pages)
        me = _Waiter((-self.bid(ctx), next(self._arrivals)), ctx, pages)
        self._insert(me)
        try:
            while True:
                if self._line[0] is me:
                    self._make_room(ctx, pages())
                    if self.store.available >= pages():
                        return
                me.event.clear()
                await me.event.wait()
        finally:
            self._line.remove(me)
            self.wake()

    def wake(self) -> None:
        """Pages, the line or what is busy changed: carry out suspensions deferred for contexts no longer busy (an
        operation that ended with no pass after it), and let the first waiter look again."""
        for ctx in [c for c in self.deferred if not self.busy(c)]:
            self.suspend(ctx)
        if self._line:
            self._line[0].event.set()

    # -- pages for passes, and restores ---------------------------------------------------------------------------

    def charge(self, ctx: int, pages: int) -> None:
        """``pages`` new pages were made for ``ctx``: its process pays for them."""
        if self._made is not None:
            self._made(self.owners[ctx], pages)

    def grant(self, ctx: int, pages: int) -> list[int]:
        """Reserve ``pages`` that ``try_now`` allowed for ``ctx``; returns them."""
        self.charge(ctx, pages)
        return self.contexts.reserve(ctx, pages)

    async def reserve(self, ctx: int, new_tokens: int) -> None:
        """Reserve the pages a pass needs. When the pool is short, or a higher bidder waits, the context suspends
        itself (if it can be recomputed) and comes back through the line, so it never waits while holding pages
        that those ahead of it need."""
        need = pages_to_reserve(self.contexts.view(ctx), new_tokens)
        if need <= 0:
            return
        self.charge(ctx, need)
        if self.try_now(ctx, need):
            self.contexts.reserve(ctx, need)
        elif self.suspend(ctx):
            await self.restore(ctx, new_tokens)
        else:
            await self.wait_for(ctx, lambda: pages_to_reserve(self.contexts.view(ctx), new_tokens))
            self.contexts.reserve(ctx, pages_to_reserve(self.contexts.view(ctx), new_tokens))

    async def restore(self, ctx: int, new_tokens: int = 0) -> None:
        """Bring a suspended context back: wait in line for its pages (plus room for ``new_tokens``), adopt the
        prefix pages still cached, and copy the rest back from host memory or recompute it; committed and working
        tokens end as before."""
        suspended = self.suspended.get(ctx)
        if suspended is None:
            return
        text, committed = suspended.text, suspended.committed
        pages = pages_for(len(text) + new_tokens, self.store.page_size)
        await self.wait_for(ctx, lambda: pages)
        if self.suspended.pop(ctx, None) is None:
            raise ContextError(f"context {ctx} was released while it waited for memory")
        self._forget_drafts(ctx)
        tokens, positions = [t for t, _ in text], [p for _, p in text]
        reused = self.contexts.reuse_prefix(ctx, tokens[:committed], positions[:committed]) if committed else 0
        self.contexts.reserve(ctx, pages - len(self.contexts.view(ctx).page_ids))
        if suspended.host is not None:
            await self._copy_back(ctx, suspended, tokens, positions, reused)
        else:
            await self._recompute(ctx, tokens[reused:], positions[reused:], len(text) - committed)

    async def restore_for_snapshot(self, ctx: int) -> None:
        """The context resident with room for copies of its working pages, without waiting in line (the inferlet
        is blocked on this call); OutOfPages if memory is too short for that now."""
        suspended = self.suspended.get(ctx)
        if suspended is None:
            pages = self.contexts.view(ctx).working_pages  # the snapshot's copies
        else:  # its whole text back, then copies of its uncommitted part
            pages = suspended.pages + pages_for(len(suspended.text) - suspended.committed, self.store.page_size)
        if not self.try_now(ctx, pages):
            raise OutOfPages(pages, self.store.available, self.store.num_pages)
        await self.restore(ctx)

    def seq_len(self, ctx: int) -> int:
        """The context's length, whether it is resident or suspended."""
        suspended = self.suspended.get(ctx)
        return len(suspended.text) if suspended else self.contexts.view(ctx).seq_len

    async def _copy_back(
        self, ctx: int, suspended: Suspended, tokens: list[int], positions: list[int], reused: int
    ) -> None:
        """Restore a context's pages from host memory (past the ``reused`` tokens adopted from the cache): copy
        them into its reserved pages, then record and commit its tokens as the passes that wrote them did."""
        page_size = self.store.page_size
        try:
            page_ids = self.contexts.view(ctx).page_ids
            first, last = reused // page_size, pages_for(len(tokens), page_size)
            await self._copy_in([(suspended.host[i], page_ids[i]) for i in range(first, last)])
        finally:
            self.release_host(suspended.host)
        self.contexts.record(ctx, tokens[reused:], positions[reused:])
        if full := (suspended.committed - reused) // page_size:
            self.contexts.commit(ctx, full)

    def _insert(self, waiter: _Waiter) -> None:
        self._line.append(waiter)
        self._line.sort()
        self.wake()

    def _make_room(self, requester: int | None, pages: int) -> None:
        if self.store.available >= pages:
            return
        bid, idle_since = self.bid(requester), self._clock() - IDLE_BATCHES
        victims = [
            c
            for c in self.contexts.ids()
            if c != requester
            and c not in self.suspended
            and (self.bid(c) < bid or (self.bid(c) == bid and self._last_use.get(c, -1) <= idle_since))
            and self.contexts.holds_pages(c)
        ]
        victims.sort(key=lambda c: (self.bid(c), self._last_use.get(c, -1)))
        coming = sum(len(self.contexts.view(c).page_ids) for c in self.deferred)  # at most, once they suspend
        for victim in victims:
            if self.store.available + coming >= pages:
                return
            if victim in self.deferred:
                continue
            self.suspend_or_defer(victim)
            if victim in self.deferred:
                coming += len(self.contexts.view(victim).page_ids)
