"""The cluster's one market as a named Ray actor, and the way every component finds it.

Ray restarts it when its process dies, and it comes back with its wallets: the market's state is written to the
GCS's key-value store (``GcsStore``) as soon as wallets open or close (one GCS write per call; the wallets a process
opens or closes in one event-loop turn come as one call, ``wallet_calls.py``), and at most ``SAVE_EVERY_S`` after a
round (a write per round would put the GCS on every replica's step), so a restart loses at most that much of the
rounds' rent and dividends. The books stay balanced: a saved state is one the market was in. Calls in flight when it
died are sent again to the restarted one (joining and leaving twice are harmless).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from pie_cluster.gcs_store import GcsStore
from pie_cluster.market.market import DEFAULT_ENDOWMENT, MAX_ENDOWMENT, Market
from pie_cluster.market.wallets import MICRO, Ledger
from pie_cluster.market.wire import Account, DeviceDecision, DeviceReport

MARKET_NAME = "pie-market"
SAVE_EVERY_S = 0.25


@dataclass(frozen=True)
class MarketSummary:
    """The market as ``pie status`` shows it under ``market``."""

    wallets: int  # open ones: a process's from its join to its leave
    held: float  # credits in them
    balanced: bool  # the books' conservation invariant (``Ledger.balanced``)
    restored: bool  # this actor came back from a saved state after a restart


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class MarketActor:
    """``Market`` behind an actor. Async, so that calls from many replicas and inferlets queue cheaply; each method
    runs to completion on the actor's event loop without awaiting, so rounds and wallet changes never interleave."""

    def __init__(self, default_endowment: float = DEFAULT_ENDOWMENT, max_endowment: float = MAX_ENDOWMENT) -> None:
        self._stored = GcsStore("pie-market", ray.get_runtime_context().get_actor_id())  # the same after a restart
        saved = self._stored.get(()) if ray.get_runtime_context().was_current_actor_reconstructed else None
        self._market = saved if saved is not None else Market(default_endowment, max_endowment)
        self._market.max_endowment = max_endowment  # the configured bound, over a saved one
        self.restored = saved is not None
        self._saving: asyncio.TimerHandle | None = None
        self._save()

    def _save(self) -> None:
        if self._saving is not None:
            self._saving.cancel()
            self._saving = None
        self._stored.put((), self._market)

    def _save_soon(self) -> None:
        if self._saving is None:
            self._saving = asyncio.get_running_loop().call_later(SAVE_EVERY_S, self._save)

    async def join(self, process_id: str, endowment: float | None = None) -> float:
        """Open the process's wallet; a second join of the same process (a call sent again after a restart) finds
        it open and changes nothing."""
        [joined] = await self.join_many([(process_id, endowment)])
        if isinstance(joined, ValueError):
            raise joined
        return joined

    async def join_many(self, joins: Sequence[tuple[str, float | None]]) -> list[float | ValueError]:
        """``join`` for each ``(process_id, endowment)``, with one write of the state for them all (a host's
        launches in one event-loop turn come as one call: ``wallet_calls.py``); an endowment out of range is that
        join's answer (the ``ValueError``), not the batch's failure."""
        joined = [self._join(process_id, endowment) for process_id, endowment in joins]
        self._save()  # at once: a wallet forgotten by a restart would be a launch's credits gone
        return joined

    def _join(self, process_id: str, endowment: float | None) -> float | ValueError:
        if (account := self._market.wallets.slot(process_id)) is not None:
            return self._market.wallets.endowment[account] / MICRO
        try:
            return self._market.join(process_id, endowment)
        except ValueError as e:
            return e

    async def leave(self, process_id: str) -> float:
        [left] = await self.leave_many([process_id])
        return left

    async def leave_many(self, process_ids: Sequence[str]) -> list[float]:
        """``leave`` for each process, with one write of the state for them all."""
        left = [self._market.leave(process_id) for process_id in process_ids]
        self._save()  # at once: a closed wallet that a restart reopened would stay open for good
        return left

    async def settle(self, reports: Sequence[DeviceReport]) -> list[DeviceDecision]:
        decisions = self._market.settle(reports)
        self._save_soon()
        return decisions

    async def account(self, process_id: str) -> Account:
        return self._market.account(process_id)

    async def settle_and_read(self, report: DeviceReport) -> tuple[DeviceDecision, dict[str, Account]]:
        """One device's round and, after it, the accounts of the processes it named: a replica's one call a round."""
        [decision] = self._market.settle([report])
        self._save_soon()
        return decision, await self.accounts(report["processes"])

    async def accounts(self, process_ids: Sequence[str]) -> dict[str, Account]:
        """The accounts of those of ``process_ids`` that have joined (a replica refreshes its cache with this)."""
        return {p: self._market.account(p) for p in process_ids if self._market.wallets.slot(p) is not None}

    async def ledger(self) -> Ledger:
        return self._market.ledger()

    async def summary(self) -> MarketSummary:
        """Open wallets and the credits they hold (for ``pie status``)."""
        ledger = self._market.ledger()
        return MarketSummary(self._market.wallets.live, ledger.held / MICRO, ledger.balanced, self.restored)


def get_or_create_market(
    namespace: str = "pie",
    default_endowment: float = DEFAULT_ENDOWMENT,
    lifetime: str | None = None,
    placement: dict | None = None,
    max_endowment: float = MAX_ENDOWMENT,
) -> ray.actor.ActorHandle:
    """The market named ``MARKET_NAME`` in ``namespace``, started here if no one has started it yet
    (``lifetime="detached"`` lets it outlive the job that started it; ``placement``: actor options saying where
    it runs; ``max_endowment``: the most credits one process is endowed with)."""
    options = {"name": MARKET_NAME, "namespace": namespace, "get_if_exists": True, "lifetime": lifetime}
    return MarketActor.options(**options, **(placement or {})).remote(default_endowment, max_endowment)
