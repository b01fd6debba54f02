"""Properties of the market over random inputs: the auction equals a one-context-at-a-time walk of the documented
rule and has its ordering property; over random sequences of joins, leaves, reports (bids, holdings, pages made)
the ledger balances exactly, no balance goes negative, an uncontended device costs nothing, and suspended contexts
come back highest (affordable) bid first."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pie_cluster.market import MICRO, Market, clear
from pie_cluster.market.wallets import split_in_proportion

BIDS = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 8.0])  # few values, so ties are common
PAGES = st.integers(0, 48).map(lambda quarters: quarters / 4)  # dyadic: sums are exact, as the walk assumes


def walk(bids, pages, resident, capacity):
    """The documented rule, one context at a time: (admitted flags, price, ranking)."""
    ranking = sorted(range(len(bids)), key=lambda i: (-bids[i], not resident[i], i))
    admitted, room, excluded = [False] * len(bids), capacity, []
    for i in ranking:
        if pages[i] <= room:
            admitted[i], room = True, room - pages[i]
        else:
            excluded.append(i)
    return admitted, (bids[excluded[0]] if excluded else 0.0), ranking


contexts = st.lists(st.tuples(BIDS, PAGES, st.booleans()), max_size=40)


@settings(max_examples=300)
@given(contexts, st.integers(0, 400).map(lambda quarters: quarters / 4))
def test_the_auction_is_the_documented_walk_and_keeps_its_ordering_property(rows, capacity):
    bids, pages, resident = (np.array(column) for column in zip(*rows, strict=True)) if rows else (np.zeros(0),) * 3
    outcome = clear(bids.astype(float), pages.astype(float), resident.astype(bool), capacity)
    admitted, price, ranking = walk(list(bids), list(pages), list(resident), capacity)
    assert outcome.admitted.tolist() == admitted and outcome.price == price and outcome.ranking.tolist() == ranking

    assert pages[outcome.admitted].sum() <= capacity
    if pages.sum() <= capacity:
        assert outcome.admitted.all() and outcome.price == 0
    # Ordering: an excluded context did not fit in the room the winners above it left, so every winner below it is
    # smaller; winners above the first excluded context bid at least the price.
    filled = 0.0
    for position, i in enumerate(ranking):
        if outcome.admitted[i]:
            filled += pages[i]
        else:
            assert pages[i] > capacity - filled
            assert all(pages[j] < pages[i] for j in ranking[position:] if outcome.admitted[j])
    first_loser = next((p for p, i in enumerate(ranking) if not outcome.admitted[i]), len(ranking))
    assert all(bids[i] >= outcome.price for i in ranking[:first_loser])


def test_the_walk_finishes_one_context_at_a_time_when_prefixes_are_short():
    """Each prefix round admits one small context and excludes one large one: more rounds than are vectorized."""
    pages = np.array([size for k in range(30) for size in (1.0, 99.5 - k)])
    bids = np.arange(pages.size, 0, -1, dtype=float)
    resident = np.zeros(pages.size, bool)
    outcome = clear(bids, pages, resident, 100.0)
    admitted, price, _ = walk(bids.tolist(), pages.tolist(), resident.tolist(), 100.0)
    assert outcome.admitted.tolist() == admitted and outcome.price == price == bids[1]


@settings(max_examples=300)
@given(st.integers(0, 2**50), st.lists(st.integers(0, 2**40), min_size=1, max_size=30).filter(any))
def test_dividends_split_exactly_and_within_one_unit_of_proportional(total, weights):
    shares = split_in_proportion(total, np.array(weights, np.int64))
    assert int(shares.sum()) == total and (shares >= 0).all()
    for share, weight in zip(shares.tolist(), weights, strict=True):
        assert abs(share - Fraction(total * weight, sum(weights))) < 1


# -- random market histories ---------------------------------------------------------------------------------------

PROCESSES = [f"p{k}" for k in range(6)]
ENDOWMENTS = st.sampled_from([0.0, 0.5, 3.0, 10.0, 64.0, 1000.0])
joins = st.tuples(st.just("join"), st.sampled_from(PROCESSES), ENDOWMENTS)
leaves = st.tuples(st.just("leave"), st.sampled_from(PROCESSES))
reports = st.tuples(
    st.just("report"),
    st.sampled_from(["gpu0", "gpu1"]),
    st.integers(0, 120).map(lambda quarters: quarters / 4),
    st.lists(st.tuples(st.sampled_from(PROCESSES), BIDS, PAGES, st.booleans()), max_size=12),
    st.dictionaries(st.sampled_from(PROCESSES), st.integers(0, 20), max_size=3),
    st.integers(1, 3),
)


def affordable_bids(market, processes, owners, bids, pages, made, ticks):
    """The rule "a bid counts up to what its process can pay": balance after make cost / (ticks × its pages)."""
    capped = []
    for owner, bid in zip(owners, bids, strict=True):
        slot = market.wallets.slot(processes[owner])
        if slot is None:  # a process the market does not know affords nothing, whatever it holds
            capped.append(0.0)
            continue
        balance = max(int(market.wallets.balance[slot]) - made[owner] * MICRO, 0)
        demand = sum(p for o, p in zip(owners, pages, strict=True) if o == owner) * ticks
        capped.append(min(bid, balance / MICRO / demand) if demand else bid)
    return capped


def settle_and_check(market, device, capacity, rows, made_by, ticks):
    processes = sorted({row[0] for row in rows} | set(made_by))
    owners = [processes.index(row[0]) for row in rows]
    bids, pages, resident = [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    made = [made_by.get(p, 0) for p in processes]
    capped = affordable_bids(market, processes, owners, bids, pages, made, ticks)
    [decision] = market.settle(
        [
            {
                "device": device,
                "capacity": capacity,
                "processes": processes,
                "owners": owners,
                "contexts": list(range(100, 100 + len(rows))),
                "bids": bids,
                "pages": pages,
                "resident": resident,
                "made": made,
                "ticks": ticks,
            }
        ]
    )
    admitted, price, ranking = walk(capped, pages, resident, capacity)
    ids = [100 + i for i in ranking]
    assert decision["price"] == price
    assert decision["restore"] == [c for c, i in zip(ids, ranking, strict=True) if admitted[i] and not resident[i]]
    assert decision["waiting"] == [c for c, i in zip(ids, ranking, strict=True) if not admitted[i] and not resident[i]]
    assert (
        decision["suspend"] == [c for c, i in zip(ids, ranking, strict=True) if not admitted[i] and resident[i]][::-1]
    )
    restored_bids = [capped[c - 100] for c in decision["restore"]]
    assert restored_bids == sorted(restored_bids, reverse=True)
    if sum(pages) <= capacity:
        assert price == 0 and decision["suspend"] == decision["waiting"] == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(ENDOWMENTS, min_size=len(PROCESSES), max_size=len(PROCESSES)),
    st.lists(st.one_of(joins, leaves, reports, reports), max_size=25),
)
def test_random_histories_conserve_credit_and_follow_the_rules(endowments, operations):
    market, live = Market(), set()
    for operation in [("join", p, e) for p, e in zip(PROCESSES, endowments, strict=True)] + operations:
        before = market.ledger()
        match operation:
            case ("join", process, endowment) if process not in live:
                market.join(process, endowment)
                live.add(process)
                assert market.ledger().issued == before.issued + round(endowment * MICRO)
            case ("leave", process):
                returned = market.leave(process)
                assert market.ledger().returned == before.returned + round(returned * MICRO)
                live.discard(process)
            case ("report", device, capacity, rows, made_by, ticks):
                settle_and_check(market, device, capacity, rows, made_by, ticks)
                assert market.ledger().issued == before.issued and market.ledger().returned == before.returned
        ledger = market.ledger()
        assert ledger.balanced
        assert (market.wallets.balance >= 0).all()
