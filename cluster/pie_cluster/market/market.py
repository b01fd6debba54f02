"""The KV-page market: a wallet per process, and per device a round of auction, rent, dividends and make cost.

Replicas keep page allocation local and report each device's contexts in one batch; the round settles in the same
call and returns the device's decision (who is suspended, who comes back, the price). The rules:

* Endowment. A process joins with an endowment in credits (the launcher derives it from the launch's token budget,
  or leaves it to the configured default); its balance starts equal to it. Endowments are set by the trusted side
  only (the launcher, through the host that opens the wallet; a sandboxed worker has no way to the market) and are
  at most ``max_endowment`` (``[limits]``): a larger token budget still limits the launch's tokens, but endows no
  more credits, since credits buy pages and earn dividends from every other process's rent.
* A round, for one device, in this order:

  1. Make cost: each page made since the previous report costs ``PAGE_COST`` = 1 credit, burned (paid to nobody).
     The pages exist already, so a process that cannot pay for them pays what it has.
  2. Inability to pay: a context's effective bid is its bid capped at what its process can afford,
     balance / (ticks × Σ effective pages of the process's contexts in the report); an unknown process affords 0.
     A process that cannot pay rent loses rank instead of running into debt; its rent below can never exceed its
     balance. The caps go back to the replica, which ranks its contexts by capped bids until the next round.
  3. Auction (``auction.clear``): the device's contexts, resident and suspended, are ranked by effective bid; those
     that fit stay (or come back); the clearing price is the highest excluded bid, 0 when everything fits — so a
     device that is not full never charges rent and never suspends anyone.
  4. Rent: every admitted context pays min(price, its effective bid) × effective pages × ticks. Winners ranked above
     every loser pay the clearing price (a second price: their own bid does not set it); a winner admitted below a
     loser by backfill bids less than the price and pays its bid, never more.
  5. Dividends: the round's rent is shared among all live processes in proportion to endowment.

* Leaving: a leaver's balance is returned — taken out of circulation and recorded in the ledger as ``returned`` —
  not handed to the others; credits are issued per launch and do not outlive it. Reports that still name it after
  it left are treated as any unknown process's: its contexts bid 0, pay nothing and receive nothing.
* Conservation, exact in integer micro-credits (``wallets.Ledger.balanced``), after every operation:
  Σ live balances = Σ endowments issued − cumulative make cost − Σ balances returned by leavers.
  Rent only moves credits between processes; only making pages and leaving take them out.
* Effective pages are Shapley shares: a page shared by h holders costs each of them 1/h (the replica computes them
  from its prefix trie). The knapsack treats them as sizes; their sum over the residents is the pages the residents
  hold, and when a suspension changes who shares a prefix, the next round sees the new shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pie_cluster.market.auction import clear
from pie_cluster.market.wallets import MICRO, NOBODY, Ledger, Wallets, to_credits
from pie_cluster.market.wire import Account, DeviceDecision, DeviceReport

PAGE_COST = 1.0
"""Credits per new KV page: ``scheduling.price()``."""

DEFAULT_ENDOWMENT = 64.0
"""Credits of a process launched without a token budget (Pie's default: 64 pages)."""

MAX_ENDOWMENT = 65536.0
"""The most credits one process is endowed with (``[limits] max_endowment``): a budget of ~1M tokens at 16 a page."""


def endowment_for(token_budget: int | None, page_size: int) -> float | None:
    """Pie's rule: a budget of T tokens endows ceil(T / page size) credits, one per page it can make (None: no
    budget, the market's default endowment)."""
    return None if token_budget is None else float(math.ceil(token_budget / page_size))


_LARGEST_MADE = 2**40
"""Pages made per report beyond which the report is certainly corrupt (keeps micro-credit products in int64)."""


@dataclass(frozen=True)
class _Round:
    """A validated report, as arrays."""

    device: str
    capacity: float
    processes: list[str]
    owners: np.ndarray
    contexts: np.ndarray
    bids: np.ndarray
    pages: np.ndarray
    resident: np.ndarray
    made: np.ndarray
    ticks: int
    latency_s: float


@dataclass(frozen=True)
class _DeviceState:
    """What the latest round of a device left for ``account`` to read."""

    price: float
    latency_s: float
    holders: np.ndarray
    """Sorted slots of the processes with contexts on the device."""
    rent: np.ndarray
    """Micro-credits each holder paid."""
    dividends: np.ndarray
    """Micro-credits each slot received."""


class Market:
    """Wallets and the per-device rounds; plain Python, driven by the Ray actor in ``actor.py``."""

    def __init__(self, default_endowment: float = DEFAULT_ENDOWMENT, max_endowment: float = MAX_ENDOWMENT) -> None:
        self.wallets = Wallets()
        self.default_endowment = default_endowment
        self.max_endowment = max_endowment
        self._devices: dict[str, _DeviceState] = {}

    def join(self, process_id: str, endowment: float | None = None) -> float:
        """Open the process's wallet with ``endowment`` credits (None: the default), at most ``max_endowment``;
        returns its endowment."""
        endowment = self.default_endowment if endowment is None else endowment
        if math.isfinite(endowment) and endowment >= 0:  # (any other is the wallets' to refuse, naming it)
            endowment = min(endowment, self.max_endowment)
        self.wallets.join(process_id, endowment)
        return endowment

    def leave(self, process_id: str) -> float:
        """Close the wallet; returns the credits taken out with it (0 for a process that is not here)."""
        closed = self.wallets.leave(process_id)
        if closed is None:
            return 0.0
        slot, returned = closed
        for device, state in self._devices.items():
            kept = state.holders != slot
            if state.dividends.size > slot:
                state.dividends[slot] = 0
            self._devices[device] = _DeviceState(
                state.price, state.latency_s, state.holders[kept], state.rent[kept], state.dividends
            )
        return to_credits(returned)

    def settle(self, reports: Sequence[DeviceReport]) -> list[DeviceDecision]:
        """Run one round per report, in order; every report is validated before any is applied."""
        rounds = [_parse(report) for report in reports]
        return [self._settle(r) for r in rounds]

    def account(self, process_id: str) -> Account:
        slot = self.wallets.slot(process_id)
        if slot is None:
            raise KeyError(f"process {process_id!r} has not joined the market")
        rent = dividend = 0
        prices: dict[str, float] = {}
        latency: dict[str, float] = {}
        for device, state in self._devices.items():
            if state.dividends.size > slot:
                dividend += int(state.dividends[slot])
            at = int(np.searchsorted(state.holders, slot))
            if at < state.holders.size and state.holders[at] == slot:
                rent += int(state.rent[at])
                prices[device] = state.price
                latency[device] = state.latency_s
        return Account(
            balance=to_credits(self.wallets.balance[slot]),
            endowment=to_credits(self.wallets.endowment[slot]),
            rent=to_credits(rent),
            dividend=to_credits(dividend),
            page_cost=PAGE_COST,
            prices=prices,
            latency=latency,
        )

    def ledger(self) -> Ledger:
        return self.wallets.ledger()

    def _settle(self, r: _Round) -> DeviceDecision:
        wallets = self.wallets
        slots = wallets.slots_of(r.processes)
        wallets.charge_pages_made(slots, r.made)

        demand = np.bincount(r.owners, weights=r.pages, minlength=slots.size) * r.ticks
        affordable = np.full(slots.size, np.inf)
        np.divide(wallets.balance[slots] / MICRO, demand, out=affordable, where=demand > 0)
        affordable[slots == NOBODY] = 0.0
        bids = np.minimum(r.bids, affordable[r.owners])

        clearing = clear(bids, r.pages, r.resident, r.capacity)
        rent_per_page = np.minimum(bids, clearing.price) * clearing.admitted
        owed = np.bincount(r.owners, weights=rent_per_page * r.pages, minlength=slots.size) * r.ticks
        paid = wallets.charge_rent(slots, owed)
        dividends = wallets.pay_dividends(int(paid.sum()))

        holding = (np.bincount(r.owners, minlength=slots.size) > 0) & (slots != NOBODY)
        holders = slots[holding]
        by_slot = np.argsort(holders)
        self._devices[r.device] = _DeviceState(
            clearing.price, r.latency_s, holders[by_slot], paid[holding][by_slot], dividends
        )

        admitted_in_rank = clearing.admitted[clearing.ranking]
        resident_in_rank = r.resident[clearing.ranking]
        ids_in_rank = r.contexts[clearing.ranking]
        return DeviceDecision(
            device=r.device,
            price=clearing.price,
            suspend=ids_in_rank[resident_in_rank & ~admitted_in_rank][::-1].tolist(),
            restore=ids_in_rank[~resident_in_rank & admitted_in_rank].tolist(),
            waiting=ids_in_rank[~resident_in_rank & ~admitted_in_rank].tolist(),
            caps={p: float(a) for p, a in zip(r.processes, affordable.tolist(), strict=True) if a != np.inf},
        )


def _parse(report: DeviceReport) -> _Round:
    """Check a report and turn it into arrays; a bad report raises ValueError naming the device and the field."""
    device = report.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(f"market report: 'device' must be a non-empty string, got {device!r}")

    def fail(problem: str) -> ValueError:
        return ValueError(f"market report for device {device!r}: {problem}")

    missing = [
        k for k in ("capacity", "processes", "owners", "contexts", "bids", "pages", "resident") if k not in report
    ]
    if missing:
        raise fail(f"missing {', '.join(missing)}")
    try:
        capacity = float(report["capacity"])
    except (TypeError, ValueError):
        capacity = math.nan
    if not capacity >= 0:
        raise fail(f"capacity must be a number ≥ 0, got {report['capacity']!r}")
    processes = list(report["processes"])
    if len(set(processes)) != len(processes):
        raise fail("'processes' lists a process twice")
    owners = np.asarray(report["owners"], np.int64)
    n = owners.size
    if n and (owners.min() < 0 or owners.max() >= len(processes)):
        raise fail(f"'owners' must index 'processes' (0..{len(processes) - 1})")
    contexts = np.asarray(report["contexts"], np.int64)
    bids = np.asarray(report["bids"], np.float64)
    pages = np.asarray(report["pages"], np.float64)
    resident = np.asarray(report["resident"], bool)
    made = np.asarray(report.get("made", np.zeros(len(processes), np.int64)), np.int64)
    for name, values, size in (
        ("contexts", contexts, n),
        ("bids", bids, n),
        ("pages", pages, n),
        ("resident", resident, n),
        ("made", made, len(processes)),
    ):
        if values.shape != (size,):
            raise fail(f"'{name}' has shape {values.shape}, expected ({size},)")
    if not np.all((pages >= 0) & np.isfinite(pages)):
        raise fail("'pages' must be finite and ≥ 0")
    if made.size and (made.min() < 0 or made.max() > _LARGEST_MADE):
        raise fail(f"'made' must count pages between 0 and {_LARGEST_MADE}")
    ticks = report.get("ticks", 1)
    if not isinstance(ticks, int | np.integer) or ticks < 0:
        raise fail(f"'ticks' must be an integer ≥ 0, got {ticks!r}")
    latency_s = float(report.get("latency_s", 0.0))
    bids = np.where(bids > 0, bids, 0.0)  # NaN and negative bids are no bids
    return _Round(device, capacity, processes, owners, contexts, bids, pages, resident, made, int(ticks), latency_s)
