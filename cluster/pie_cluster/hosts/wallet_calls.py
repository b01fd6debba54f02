"""The market's wallets as a process opens and closes them: the joins (and leaves) it makes in one event-loop turn
go to the market as one call, which writes the market's state to the GCS once for them all.

A host launching a burst of instances (a swarm's agents, a batch of OpenAI requests) otherwise pays an actor call
per wallet, and the market a cloudpickle of its whole state and a GCS write per wallet, on its one event loop.
Not under ``market/``: this module is imported by ``host.py``, which sandboxed workers import too, and the market
package imports Ray.
"""

from __future__ import annotations

import weakref

from pie_workers.deadlines import MARKET_S

from pie_cluster.coalesced_calls import CoalescedCalls


class WalletCalls:
    def __init__(self, market):
        self._join = CoalescedCalls(market.join_many, "the market", MARKET_S)
        self._leave = CoalescedCalls(market.leave_many, "the market", MARKET_S)

    async def join(self, process_id: str, endowment: float | None) -> float:
        """Open ``process_id``'s wallet with ``endowment`` credits (None: the market's default); raises the
        market's ``ValueError`` for an endowment out of range."""
        joined = await self._join((process_id, endowment))
        if isinstance(joined, ValueError):
            raise joined
        return joined

    async def leave(self, process_id: str) -> float:
        """Close its wallet; the credits taken out with it."""
        return await self._leave(process_id)


_by_market: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wallet_calls(market) -> WalletCalls:
    """The one ``WalletCalls`` of this process for ``market`` (an actor handle): calls coalesce only through one."""
    calls = _by_market.get(market)
    if calls is None:
        calls = _by_market[market] = WalletCalls(market)
    return calls
