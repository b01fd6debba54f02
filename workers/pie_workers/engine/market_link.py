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

from pie_workers.deadlines import MARKET_S, answer
from pie_workers.engine.record import EngineContexts
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
        records: EngineContexts,
        residency: Residency,
        scheduler: BatchScheduler,
    ) -> None:
        """``residency`` counts the pages each process makes (``Residency.made``) for the reports."""
        self.market = market
        self.device = device
        self.records = records
        self.contexts = records.table
        self.residency = residency
        self.scheduler = scheduler
        self.price = 0.0  # the device's clearing price from the latest round: ``scheduling.rent``
        self.latency_s = 0.0
        self.rounds = 0
        self.accounts: dict[str, dict] = {}  # process -> its latest account (``scheduling.balance`` / ``dividend``)
        self._reported_batches = 0
        self._ending_round: asyncio.Future | None = None  # the next round endings wait for (not reported yet)
        self._endings = asyncio.Lock()  # one ending round in flight: the next gathers the endings meanwhile
        self._ending_tasks: set[asyncio.Task] = set()  # held here: the loop keeps only weak references to tasks

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
        decision, accounts = await answer(self.market.settle_and_read.remote(report), "the market", MARKET_S)
        self.apply(decision)
        self.accounts.update(accounts)
        return decision

    async def settle_ending(self) -> None:
        """A round that reports every page made until now (an inferlet ended: its wallet closes after it paid for
        its pages). The endings of a burst share one: a round already reported is in flight, so those that come
        meanwhile wait for the next, which reports for them all."""
        if self._ending_round is None:
            self._ending_round = asyncio.get_running_loop().create_future()
            task = asyncio.get_running_loop().create_task(self._settle_endings(self._ending_round))
            self._ending_tasks.add(task)
            task.add_done_callback(self._ending_tasks.discard)
        await asyncio.shield(self._ending_round)

    async def _settle_endings(self, done: asyncio.Future) -> None:
        async with self._endings:
            self._ending_round = None  # endings from now on are not in this round's report
            try:
                await self.round(settle_made=True)
            except Exception as e:
                done.set_exception(e)
                done.exception()  # retrieved: every waiter sees it; none waiting must not log it again
            else:
                done.set_result(None)

    async def account(self, process: str) -> dict | None:
        """The process's latest account (fetched now if no round has read it yet); None if it never joined."""
        if process not in self.accounts:
            self.accounts.update(await answer(self.market.accounts.remote([process]), "the market", MARKET_S))
        return self.accounts.get(process)

    def forget(self, process: str) -> None:
        self.accounts.pop(process, None)
        self.residency.forget_process(process)

    def report(self, settle_made: bool = False) -> dict | None:
        batches = self.scheduler.batches_fired
        ticks = batches - self._reported_batches
        if ticks <= 0 and not (settle_made and self.residency.made):
            return None
        self._reported_batches = batches
        self.latency_s += LATENCY_WEIGHT * (self.scheduler.last_latency_s - self.latency_s)
        waiting = self.residency.waiters()
        resident = [r for r in self.records if r.suspended is None]
        wanting = [r for r in waiting if r.suspended is not None and self.records.get(r.id) is r]
        made, self.residency.made = self.residency.made, Counter()
        processes = sorted({r.owner for r in resident + wanting} | set(made))
        index = {p: i for i, p in enumerate(processes)}
        records = resident + wanting
        return {
            "device": self.device,
            "capacity": float(self.contexts.store.num_pages),
            "processes": processes,
            "owners": [index[r.owner] for r in records],
            "contexts": [r.id for r in records],
            "bids": [r.bid for r in records],
            "pages": self.contexts.effective_pages([r.id for r in resident]) + [float(waiting[r]) for r in wanting],
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
            if (record := self.records.get(ctx)) is not None:
                self.residency.suspend_or_defer(record)
        self.residency.wake()
