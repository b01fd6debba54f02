"""The cluster's one market as a named Ray actor, and the way every component finds it."""

from __future__ import annotations

from collections.abc import Sequence

import ray

from pie_cluster.market.market import DEFAULT_ENDOWMENT, Market
from pie_cluster.market.wallets import MICRO, Ledger
from pie_cluster.market.wire import Account, DeviceDecision, DeviceReport

MARKET_NAME = "pie-market"


@ray.remote(num_cpus=0)
class MarketActor:
    """``Market`` behind an actor. Async, so that calls from many replicas and inferlets queue cheaply; each method
    runs to completion on the actor's event loop without awaiting, so rounds and wallet changes never interleave."""

    def __init__(self, default_endowment: float = DEFAULT_ENDOWMENT) -> None:
        self._market = Market(default_endowment)

    async def join(self, process_id: str, endowment: float | None = None) -> float:
        return self._market.join(process_id, endowment)

    async def leave(self, process_id: str) -> float:
        return self._market.leave(process_id)

    async def settle(self, reports: Sequence[DeviceReport]) -> list[DeviceDecision]:
        return self._market.settle(reports)

    async def account(self, process_id: str) -> Account:
        return self._market.account(process_id)

    async def settle_and_read(self, report: DeviceReport) -> tuple[DeviceDecision, dict[str, Account]]:
        """One device's round and, after it, the accounts of the processes it named: a replica's one call a round."""
        [decision] = self._market.settle([report])
        return decision, await self.accounts(report["processes"])

    async def accounts(self, process_ids: Sequence[str]) -> dict[str, Account]:
        """The accounts of those of ``process_ids`` that have joined (a replica refreshes its cache with this)."""
        return {p: self._market.account(p) for p in process_ids if self._market.wallets.slot(p) is not None}

    async def ledger(self) -> Ledger:
        return self._market.ledger()

    async def summary(self) -> dict:
        """Open wallets and the credits they hold (for ``pie status``)."""
        ledger = self._market.ledger()
        return {"wallets": self._market.wallets.live, "held": ledger.held / MICRO, "balanced": ledger.balanced}


def get_or_create_market(
    namespace: str = "pie",
    default_endowment: float = DEFAULT_ENDOWMENT,
    lifetime: str | None = None,
    scheduling_strategy=None,
) -> ray.actor.ActorHandle:
    """The market named ``MARKET_NAME`` in ``namespace``, started here if no one has started it yet
    (``lifetime="detached"`` lets it outlive the job that started it; ``scheduling_strategy``: where it runs)."""
    options = {"name": MARKET_NAME, "namespace": namespace, "get_if_exists": True, "lifetime": lifetime}
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    return MarketActor.options(**options).remote(default_endowment)
