"""The replica's side of the KV-page market: a report every round, the decision applied, accounts cached.

Page allocation never waits for the market: ``Residency`` decides locally, at once, by bid. Every ``ROUND_S`` during
which the replica fired batches, the engine sends the market actor one report for its device — each context's owner
process, bid, effective (Shapley) pages and whether it is resident, the pages each process made, the batches fired
(ticks) and the batch latency — and applies what comes back:

* the market charges rent and make cost and pays dividends, so the processes' balances move;
* its caps (what each process can afford per page) cap the bids ``Residency`` ranks by until the next round, so a
  process that cannot pay loses rank locally too;
* losers are suspended (a busy one when its next pass begins), and the line is woken.

A suspended context is in the report only while it waits in line for memory: one whose inferlet is not asking for it
competes for nothing and pays nothing. The market is an opaque Ray actor handle here (``pie_workers`` never imports
``pie_cluster``): ``settle_and_read(report) -> (decision, {process: account})`` once a round, and
``accounts(process_ids) -> {process: account}`` for a process no round has named yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from pie_workers.engine.contexts import ContextTable
from pie_workers.engine.residency import Residency
from pie_workers.engine.scheduler import BatchScheduler

log = logging.getLogger(__name__)

ROUND_S = 0.05  # seconds between reports: rounds are cheap (a few ms) but need not follow every batch
LATENCY_WEIGHT = 0.1  # exponentially weighted batch latency, as Pie reports it to ``scheduling.latency``


class MarketLink:
    def __init__(
        self,
        market: Any,
        device: str,
        contexts: ContextTable,
        residency: Residency,
        scheduler: BatchScheduler,
    ) -> None:
        self.market = market
        self.device = device
        self.contexts = contexts
        self.residency = residency
        self.scheduler = scheduler
        self.price = 0.0  # the device's clearing price from the latest round: ``scheduling.rent``
        self.latency_s = 0.0
        self.rounds = 0
        self.accounts: dict[str, dict] = {}  # process -> its latest account (``scheduling.balance`` / ``dividend``)
        self._made: Counter[str] = Counter()
        self._reported_batches = 0

    def made(self, process: str, pages: int) -> None:
        """``process`` made ``pages`` new pages on this device (charged 1 credit each at the next round)."""
        if pages > 0:
            self._made[process] += pages

    async def run(self) -> None:
        while True:
            await asyncio.sleep(ROUND_S)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # a market that cannot be reached or refuses a report never stops the replica
                log.exception("market round failed on %s", self.device)

    async def round(self, settle_made: bool = False) -> dict | None:
        """One report and its decision, if any batch fired since the last round (or, with ``settle_made``, if any
        page was made: an ending inferlet pays for its pages before its wallet closes); returns the decision."""
        report = self.report(settle_made)
        if report is None:
            return None
        decision, accounts = await self.market.settle_and_read.remote(report)
        self.apply(decision)
        self.accounts.update(accounts)
        return decision

    async def account(self, process: str) -> dict | None:
        """The process's latest account (fetched now if no round has read it yet); None if it never joined."""
        if process not in self.accounts:
            self.accounts.update(await self.market.accounts.remote([process]))
        return self.accounts.get(process)

    def forget(self, process: str) -> None:
        self.accounts.pop(process, None)
        self.residency.forget_process(process)

    def report(self, settle_made: bool = False) -> dict | None:
        batches = self.scheduler.batches_fired
        ticks = batches - self._reported_batches
        if ticks <= 0 and not (settle_made and self._made):
            return None
        self._reported_batches = batches
        self.latency_s += LATENCY_WEIGHT * (self.scheduler.last_latency_s - self.latency_s)
        owners = self.residency.owners
        waiting = self.residency.waiters()
        suspended = self.residency.suspended
        resident = [c for c in self.contexts.ids() if c in owners and c not in suspended]
        wanting = [c for c in waiting if c in suspended and c in owners]
        made, self._made = self._made, Counter()
        processes = sorted({owners[c] for c in resident + wanting} | set(made))
        index = {p: i for i, p in enumerate(processes)}
        ids = resident + wanting
        return {
            "device": self.device,
            "capacity": float(self.contexts.store.num_pages),
            "processes": processes,
            "owners": [index[owners[c]] for c in ids],
            "contexts": ids,
            "bids": [self.residency.bids.get(c, 0.0) for c in ids],
            "pages": self.contexts.effective_pages(resident) + [float(waiting[c]) for c in wanting],
            "resident": [True] * len(resident) + [False] * len(wanting),
            "made": [made.get(p, 0) for p in processes],
            "ticks": ticks,
            "latency_s": self.latency_s,
        }

    def apply(self, decision: dict) -> None:
        self.rounds += 1
        self.price = float(decision["price"])
        self.residency.set_caps(decision["caps"])
        for ctx in decision["suspend"]:
            if ctx in self.residency.owners:
                self.residency.suspend_or_defer(ctx)
        self.residency.wake()
