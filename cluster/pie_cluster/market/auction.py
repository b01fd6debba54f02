"""One device's auction: which contexts keep their KV pages resident, and the clearing price per page.

Clearing rule — a greedy knapsack by bid per page, with backfill:

1. Rank every context of the device, resident and suspended alike, by bid per page, highest first. Ties go to the
   context that is resident (equal bids never swap places), then to the one listed first.
2. Walk the ranking with the device's capacity: a context is admitted when its pages fit in the room the contexts
   admitted before it left over, and excluded otherwise. The walk goes on past an excluded context, so a later,
   smaller context may still be admitted: no room stays idle while a context that fits waits for it.
3. The clearing price is the highest excluded bid, and 0 when nothing is excluded (whenever everything fits).

Ordering property: a context X is excluded while a context Y ranked below it (a lower bid, or an equal bid behind
it in the tie order) stays admitted only if X did not fit in the room left by the winners ranked above it:
pages(X) > capacity − Σ pages(winners ranked above X) ≥ pages(Y). So X lost to a smaller context, never to a lower
bid alone; when all contexts are the same size the winners are exactly the top bidders. Every winner ranked above
the first excluded context bids at least the clearing price; winners admitted further down (by backfill) may bid less.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_VECTOR_ROUNDS = 8
"""Rounds of whole-prefix admission before the walk finishes one context at a time. A round admits the longest
prefix that fits with one cumulative sum; adversarial sizes could make every round admit just one context, so the
number of rounds is capped and the rest is a linear walk."""


@dataclass(frozen=True)
class Clearing:
    ranking: np.ndarray
    """Context indices, best first."""
    admitted: np.ndarray
    """Per context (in input order): resident after this auction."""
    price: float
    """Credits per page per tick: the highest excluded bid, or 0."""


def rank(bids: np.ndarray, resident: np.ndarray) -> np.ndarray:
    """Context indices by bid (highest first), then resident before suspended, then input order."""
    residents_first = np.argsort(~resident, kind="stable")
    return residents_first[np.argsort(-bids[residents_first], kind="stable")]


def clear(bids: np.ndarray, pages: np.ndarray, resident: np.ndarray, capacity: float) -> Clearing:
    """Run the auction of one device; ``bids`` are credits per page, ``pages`` effective pages (both ≥ 0)."""
    ranking = rank(bids, resident)
    sizes = pages[ranking]
    admitted_in_rank = np.zeros(ranking.size, bool)
    # Effective pages are sums of 1/holders: allow for float rounding when the device is filled to the page.
    room = capacity + 1e-9 * max(capacity, 1.0)
    first_excluded = -1
    undecided = np.arange(ranking.size)
    for _ in range(_VECTOR_ROUNDS):
        if not undecided.size:
            break
        filled = np.cumsum(sizes[undecided])
        fit = int(np.searchsorted(filled, room, side="right"))
        admitted_in_rank[undecided[:fit]] = True
        if fit == undecided.size:
            undecided = undecided[:0]
            break
        if fit:
            room -= filled[fit - 1]
        if first_excluded < 0:
            first_excluded = int(undecided[fit])
        later = undecided[fit + 1 :]
        undecided = later[sizes[later] <= room]
    for position, size in zip(undecided.tolist(), sizes[undecided].tolist(), strict=True):  # after an exclusion
        if size <= room:
            admitted_in_rank[position] = True
            room -= size
    admitted = np.empty_like(admitted_in_rank)
    admitted[ranking] = admitted_in_rank
    price = float(bids[ranking[first_excluded]]) if first_excluded >= 0 else 0.0
    return Clearing(ranking, admitted, price)
