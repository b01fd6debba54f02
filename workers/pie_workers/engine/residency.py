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
(written under a custom attention mask, an adapter or a zo seed: such contexts are never suspended). Snapshots bid
nothing and are idle by nature: when memory is short they go first, least recently used first, where the cluster's
directory keeps their lineage (the next open recomputes them), then those that cannot be recomputed, the user
holding the most such pages first (``ContextTable.let_go_of_snapshot``); a recomputable one no directory keeps stays.

Passes take their pages through here too (``reserve``, or ``grant`` once ``try_now`` allowed them), and every page a
context's process makes is charged to it; ``restore`` brings a suspended context back before its next operation.

What residency knows of a context is on its ``EngineContext`` (bid, suspension, deferral, last use); here are only
the line of waiters, the contexts owing a deferred suspension, and what processes can afford.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pie_workers.engine.contexts import ContextError, ContextTable
from pie_workers.engine.holding import ContextView
from pie_workers.engine.page_store import OutOfPages
from pie_workers.engine.protocol import PLAIN_PASS
from pie_workers.engine.record import EngineContext, EngineContexts
from pie_workers.engine.scheduler import BatchScheduler, prefill_chunks
from pie_workers.engine.settle import settle
from pie_workers.wire.batch import ForwardRequest
from pie_workers.wire.pages import pages_for

IDLE_BATCHES = 4  # batches without an operation after which a context counts as idle


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
    record: EngineContext = field(compare=False)
    pages: Callable[[], int] = field(compare=False)
    event: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


class Residency:
    def __init__(self, records: EngineContexts, scheduler: BatchScheduler, count_made: bool = False) -> None:
        """Suspended contexts' pages go to host memory while ``records.free_host`` has room, moved by the
        scheduler; else they are recomputed by passes. ``count_made``: count the pages each process makes, for the
        market (``made``)."""
        self.records = records
        self.contexts: ContextTable = records.table
        self.store = records.table.store
        self.scheduler = scheduler
        self._caps: dict[str, float] = {}  # process -> the highest bid per page it can afford; absent: no cap
        self._deferred: list[EngineContext] = []  # contexts that suspend when their next pass begins
        self._line: list[_Waiter] = []
        self._arrivals = itertools.count()
        self.suspensions = 0
        self.offloaded = 0  # suspensions whose pages went to host memory
        self.made: Counter[str] | None = Counter() if count_made else None  # process -> pages made since read

    def touch(self, record: EngineContext) -> None:
        """An operation used the context now."""
        record.last_use = self.scheduler.batches_fired

    def bid(self, record: EngineContext | None) -> float:
        """The context's bid per page, capped at what its process can afford."""
        if record is None:
            return 0.0
        return min(record.bid, self._caps.get(record.owner, math.inf))

    def set_caps(self, caps: dict[str, float]) -> None:
        """The market's latest word on what these processes can afford per page. A process missing from the round
        keeps its previous cap: it held no pages and wanted none, so it paid nothing since (at worst the cap is
        low by the dividends it received)."""
        self._caps.update(caps)

    def forget_process(self, process: str) -> None:
        self._caps.pop(process, None)

    @staticmethod
    def set_bid(record: EngineContext, bid: float) -> None:
        bid = float(bid)
        if not (bid >= 0.0 and math.isfinite(bid)):
            raise ValueError(f"a bid is a finite number of credits per page >= 0, got {bid!r}")
        record.bid = bid

    @property
    def waiting(self) -> int:
        return len(self._line)

    def waiters(self) -> dict[EngineContext, int]:
        """Contexts waiting in line for memory, with the pages each waits for."""
        return {w.record: w.pages() for w in self._line}

    def suspend(self, record: EngineContext) -> bool:
        """Give up the context's pages, keeping its text (and their contents in host memory when there is room);
        False if its KV could not be recomputed."""
        record.deferred = False
        ctx = record.id
        if record.suspended is not None or not self.contexts.recomputable(ctx):
            return False
        view = self.contexts.view(ctx)
        pages = view.page_ids[: pages_for(view.seq_len, self.store.page_size)]  # the pages holding its tokens
        free_host = self.records.free_host
        host = None
        if pages and len(free_host) >= len(pages):
            host = [free_host.pop() for _ in pages]
            # queued before anyone can reuse the pages
            self.scheduler.submit(None, offloads=list(zip(pages, host, strict=True)))
            self.offloaded += 1
        self.add_suspended(record, *self.contexts.evict(ctx))
        record.suspended.host = host
        self.suspensions += 1
        return True

    def suspend_or_defer(self, record: EngineContext) -> None:
        """Suspend the context now, or, while an operation on it is in flight, when its next pass begins or the
        operation ends with none after it. A Generator chains its steps, so a generating context is never between
        operations: its step boundary is the moment."""
        if not record.gate.locked():
            self.suspend(record)
        elif not record.deferred:
            record.deferred = True
            self._deferred.append(record)

    def pass_begins(self, record: EngineContext) -> None:
        """A pass on the context begins (nothing of it in a batch yet): carry out a suspension deferred until now."""
        if record.deferred:
            self.suspend(record)

    def add_suspended(self, record: EngineContext, text: list[tuple[int, int]], committed: int) -> None:
        """Record the context (holding no pages) as suspended with this text, to be recomputed on its next pass."""
        record.suspended = Suspended(list(text), committed, pages_for(len(text), self.store.page_size))

    def truncate(self, record: EngineContext, n: int) -> None:
        """Truncate a suspended context's text (only its uncommitted tokens, as for a resident one)."""
        s = record.suspended
        if not 0 <= n <= len(s.text) - s.committed:
            raise ValueError(
                f"cannot truncate {n} tokens from context {record.id}: only {len(s.text) - s.committed} of its "
                "tokens are uncommitted (committed pages cannot be truncated)"
            )
        del s.text[len(s.text) - n :]
        s.pages = pages_for(len(s.text), self.store.page_size)
        if s.host is not None:
            self.records.free_host.extend(s.host[s.pages :])
            del s.host[s.pages :]

    def try_now(self, record: EngineContext | None, pages: int) -> bool:
        """Whether the context (None: a new one) may reserve ``pages`` right away: no waiter bids as much, and the
        pool has (or suspending lower bidders makes) the room."""
        if self._line and -self._line[0].rank[0] >= self.bid(record):
            return False
        self._make_room(record, pages)
        return self.store.available >= pages

    async def wait_for(self, record: EngineContext, pages: Callable[[], int]) -> None:
        """Return once ``pages()`` pages are available to the context and no waiter outranks it; suspends lower
        bidders on the way. The caller reserves them before its next await."""
        if pages() > self.store.num_pages:
            raise OutOfPages(pages(), self.store.available, self.store.num_pages)
        me = _Waiter((-self.bid(record), next(self._arrivals)), record, pages)
        self._insert(me)
        try:
            while True:
                if self._line[0] is me:
                    self._make_room(record, pages())
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
        if self._deferred:
            for record in [r for r in self._deferred if r.deferred and not r.gate.locked()]:
                self.suspend(record)
            self._deferred = [r for r in self._deferred if r.deferred]  # suspended or destroyed meanwhile: done
        if self._line:
            self._line[0].event.set()

    # -- pages for passes, and restores ---------------------------------------------------------------------------

    def charge(self, record: EngineContext, pages: int) -> None:
        """``pages`` new pages were made for the context: its process pays for them."""
        if self.made is not None and pages > 0:
            self.made[record.owner] += pages

    def grant(self, record: EngineContext, pages: int) -> list[int]:
        """Reserve ``pages`` that ``try_now`` allowed for the context; returns them."""
        self.charge(record, pages)
        return self.contexts.reserve(record.id, pages)

    async def reserve(self, record: EngineContext, new_tokens: int) -> None:
        """Reserve the pages a pass needs. When the pool is short, or a higher bidder waits, the context suspends
        itself (if it can be recomputed) and comes back through the line, so it never waits while holding pages
        that those ahead of it need."""
        ctx = record.id
        need = pages_to_reserve(self.contexts.view(ctx), new_tokens)
        if need <= 0:
            return
        self.charge(record, need)
        if self.try_now(record, need):
            self.contexts.reserve(ctx, need)
        elif self.suspend(record):
            await self.restore(record, new_tokens)
        else:
            await self.wait_for(record, lambda: pages_to_reserve(self.contexts.view(ctx), new_tokens))
            self.contexts.reserve(ctx, pages_to_reserve(self.contexts.view(ctx), new_tokens))

    async def restore(self, record: EngineContext, new_tokens: int = 0) -> None:
        """Bring a suspended context back: wait in line for its pages (plus room for ``new_tokens``), adopt the
        prefix pages still cached, and copy the rest back from host memory or recompute it; committed and working
        tokens end as before."""
        suspended = record.suspended
        if suspended is None:
            return
        ctx = record.id
        text, committed = suspended.text, suspended.committed
        pages = pages_for(len(text) + new_tokens, self.store.page_size)
        await self.wait_for(record, lambda: pages)
        if record.suspended is None:
            raise ContextError(f"context {ctx} was released while it waited for memory")
        record.suspended = None
        record.drafts = None
        tokens, positions = [t for t, _ in text], [p for _, p in text]
        reused = self.contexts.reuse_prefix(ctx, tokens[:committed], positions[:committed]) if committed else 0
        self.contexts.reserve(ctx, pages - len(self.contexts.view(ctx).page_ids))
        if suspended.host is not None:
            await self._copy_back(ctx, suspended, tokens, positions, reused)
        else:
            await self._recompute(record, tokens[reused:], positions[reused:], len(text) - committed)

    async def restore_for_snapshot(self, record: EngineContext) -> None:
        """The context resident with room for copies of its working pages, without waiting in line (the inferlet
        is blocked on this call); OutOfPages if memory is too short for that now."""
        suspended = record.suspended
        if suspended is None:
            pages = self.contexts.view(record.id).working_pages  # the snapshot's copies
        else:  # its whole text back, then copies of its uncommitted part
            pages = suspended.pages + pages_for(len(suspended.text) - suspended.committed, self.store.page_size)
        if not self.try_now(record, pages):
            raise OutOfPages(pages, self.store.available, self.store.num_pages)
        await self.restore(record)

    def seq_len(self, record: EngineContext) -> int:
        """The context's length, whether it is resident or suspended."""
        suspended = record.suspended
        return len(suspended.text) if suspended else self.contexts.view(record.id).seq_len

    def tail(self, record: EngineContext, start: int) -> tuple[list[int], list[int]]:
        """The context's tokens and positions from index ``start`` on, whether it is resident or suspended: what
        an inferlet mirroring its lineage has not seen yet."""
        if (suspended := record.suspended) is None:
            return self.contexts.text_from(record.id, start)
        text = suspended.text[start:]
        return [t for t, _ in text], [p for _, p in text]

    async def _recompute(self, record: EngineContext, tokens: list[int], positions: list[int], hold: int) -> None:
        """Rebuild a restored context's KV for these tokens by passes, in chunks a batch takes, into the pages
        already reserved; pages touching the last ``hold`` tokens stay uncommitted, as they were."""
        for start, end in prefill_chunks(len(tokens), self.scheduler.limits.max_tokens):
            view = self.contexts.view(record.id)
            request = ForwardRequest(
                token_ids=tokens[start:end],
                positions=positions[start:end],
                page_ids=list(view.page_ids),
                kv_len=view.seq_len,
            )
            out = await self.scheduler.submit(request)
            settle(self.contexts, record, request, out, hold, PLAIN_PASS.salt, trim_pages=False)

    async def _copy_back(
        self, ctx: int, suspended: Suspended, tokens: list[int], positions: list[int], reused: int
    ) -> None:
        """Restore a context's pages from host memory (past the ``reused`` tokens adopted from the cache): copy
        them into its reserved pages, then record and commit its tokens as the passes that wrote them did."""
        page_size = self.store.page_size
        try:
            page_ids = self.contexts.view(ctx).page_ids
            first, last = reused // page_size, pages_for(len(tokens), page_size)
            await self.scheduler.submit(None, restores=[(suspended.host[i], page_ids[i]) for i in range(first, last)])
        finally:
            self.records.free_host.extend(suspended.host)
        self.contexts.record(ctx, tokens[reused:], positions[reused:])
        if full := (suspended.committed - reused) // page_size:
            self.contexts.commit(ctx, full)

    def _insert(self, waiter: _Waiter) -> None:
        self._line.append(waiter)
        self._line.sort()
        self.wake()

    def _make_room(self, requester: EngineContext | None, pages: int) -> None:
        while self.store.available < pages and self.contexts.let_go_of_snapshot():
            pass
        if self.store.available >= pages:
            return
        bid, idle_since = self.bid(requester), self.scheduler.batches_fired - IDLE_BATCHES
        victims = [
            r
            for r in self.records
            if r is not requester
            and r.suspended is None
            and (self.bid(r) < bid or (self.bid(r) == bid and r.last_use <= idle_since))
            and self.contexts.holds_pages(r.id)
        ]
        victims.sort(key=lambda r: (self.bid(r), r.last_use))
        # at most, once they suspend
        coming = sum(len(self.contexts.view(r.id).page_ids) for r in self._deferred if r.deferred)
        for victim in victims:
            if self.store.available + coming >= pages:
                return
            if victim.deferred:
                continue
            self.suspend_or_defer(victim)
            if victim.deferred:
                coming += len(self.contexts.view(victim.id).page_ids)
