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
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pie_workers.engine.contexts import ContextTable
from pie_workers.engine.page_store import OutOfPages
from pie_workers.wire.pages import pages_for

IDLE_BATCHES = 4  # batches without an operation after which a context counts as idle


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
        offload: Callable[[list[tuple[int, int]]], None] | None = None,
    ) -> None:
        """``offload(pairs)`` queues copies of (page, host slot) that run before any later use of those pages."""
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
