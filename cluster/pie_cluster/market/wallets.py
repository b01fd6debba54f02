"""Every process's wallet (endowment, balance) and the ledger that proves no credit is created or lost.

Amounts are integer micro-credits (``MICRO`` per credit) in numpy int64 arrays indexed by a slot per process. Integers
make conservation exact — the ledger identity is checked with ``==``, not a tolerance — and make "no negative balance"
a plain integer comparison; floats appear only where a price is multiplied out, and are floored into micro-credits
before they touch a balance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

MICRO = 1_000_000
"""Micro-credits per credit: the unit of every stored amount."""

NOBODY = 0
"""The slot of every process the market does not know (never joined, or already left): balance and endowment 0, so its
contexts cannot pay and it receives no dividends."""

_LARGEST_ENDOWMENT = 10**12
"""In credits; keeps every int64 sum of balances far from overflow."""


def to_micro(credits: float) -> int:
    return round(credits * MICRO)


def to_credits(micro: int | np.integer) -> float:
    return int(micro) / MICRO


def split_in_proportion(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` units shared in proportion to non-negative integer ``weights``, adding up to ``total`` exactly.

    Each share is its proportional value floored; the units that flooring leaves over go one each to the largest
    remainders (Hamilton's method), so every share is within one unit of proportional. The proportional values are
    computed in float64 and the integer correction absorbs its rounding, so the sum is exact for any int64 input.
    """
    shares = np.zeros(weights.shape, np.int64)
    if total == 0:
        return shares
    holders = np.flatnonzero(weights)
    exact = weights[holders] * (total / int(weights[holders].sum()))
    floored = np.floor(exact).astype(np.int64)
    left = total - int(floored.sum())
    if left:
        whole, extra = divmod(abs(left), holders.size)
        step = 1 if left > 0 else -1
        # Give to the most under-paid first; take (only after float overshoot) from the most over-paid.
        shortfall = (exact - floored) * step
        floored += step * whole
        if extra:
            floored[np.argpartition(-shortfall, extra - 1)[:extra]] += step
    shares[holders] = floored
    return shares


@dataclass(frozen=True)
class Ledger:
    """Totals in micro-credits. ``balanced`` is the market's conservation invariant:
    Σ live balances = Σ endowments ever issued − cumulative make cost − Σ balances returned by leavers."""

    held: int
    issued: int
    burned: int
    returned: int

    @property
    def balanced(self) -> bool:
        return self.held == self.issued - self.burned - self.returned


class Wallets:
    """Balances and endowments of the live processes, by slot; slot ``NOBODY`` stands for every unknown process."""

    def __init__(self) -> None:
        self._slot_of: dict[str, int] = {}
        self.balance = np.zeros(16, np.int64)
        self.endowment = np.zeros(16, np.int64)
        self._free = list(range(15, NOBODY, -1))
        self.issued = 0
        self.burned = 0
        self.returned = 0

    def join(self, process_id: str, endowment: float) -> int:
        """Open a wallet holding ``endowment`` credits; returns the process's slot."""
        if process_id in self._slot_of:
            raise ValueError(f"process {process_id!r} has already joined the market")
        if not (0 <= endowment <= _LARGEST_ENDOWMENT):
            raise ValueError(f"endowment of {process_id!r} must be between 0 and 1e12 credits, got {endowment!r}")
        if not self._free:
            self._grow()
        slot = self._free.pop()
        micro = to_micro(endowment)
        self._slot_of[process_id] = slot
        self.balance[slot] = self.endowment[slot] = micro
        self.issued += micro
        return slot

    def leave(self, process_id: str) -> tuple[int, int] | None:
        """Close the wallet; returns (slot, micro-credits returned), or None for a process that is not here."""
        slot = self._slot_of.pop(process_id, None)
        if slot is None:
            return None
        returned = int(self.balance[slot])
        self.returned += returned
        self.balance[slot] = self.endowment[slot] = 0
        self._free.append(slot)
        return slot, returned

    @property
    def live(self) -> int:
        """Open wallets."""
        return len(self._slot_of)

    def slot(self, process_id: str) -> int | None:
        return self._slot_of.get(process_id)

    def slots_of(self, process_ids: Sequence[str]) -> np.ndarray:
        return np.fromiter(map(self._slot_of.get, process_ids, repeat(NOBODY)), np.int64, len(process_ids))

    def charge_pages_made(self, slots: np.ndarray, pages: np.ndarray) -> None:
        """Burn the make cost of new pages (1 credit each), as far as each balance goes: the pages already exist."""
        cost = np.minimum(pages * MICRO, self.balance[slots])
        self.balance[slots] -= cost
        self.burned += int(cost.sum())

    def charge_rent(self, slots: np.ndarray, owed: np.ndarray) -> np.ndarray:
        """Debit rent owed in (float) credits, floored to micro-credits and never below zero; returns what was paid."""
        balance = self.balance[slots]
        paid = np.minimum(np.floor(np.minimum(owed * MICRO, balance)).astype(np.int64), balance)
        self.balance[slots] -= paid
        return paid

    def pay_dividends(self, revenue: int) -> np.ndarray:
        """Share ``revenue`` among all live processes in proportion to endowment; returns the shares by slot.

        Only a process with a positive endowment can ever hold credits to pay rent with, so whenever there is revenue
        the total endowment is positive and every micro-credit finds an owner."""
        shares = split_in_proportion(revenue, self.endowment)
        self.balance += shares
        return shares

    def ledger(self) -> Ledger:
        return Ledger(int(self.balance.sum()), self.issued, self.burned, self.returned)

    def _grow(self) -> None:
        size = self.balance.size
        self.balance = np.concatenate([self.balance, np.zeros(size, np.int64)])
        self.endowment = np.concatenate([self.endowment, np.zeros(size, np.int64)])
        self._free = list(range(2 * size - 1, size - 1, -1))
