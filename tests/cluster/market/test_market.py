"""The KV-page market: Pie's market tests (reference/market.md §12) recomputed for the documented mechanism — a
per-device second-price knapsack auction whose price is the highest excluded bid, rent on every resident page, make
cost 1 credit per page — plus the rules this implementation chose (leavers, inability to pay, ties, backfill)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.market import DEFAULT_ENDOWMENT, MICRO, PAGE_COST, Market, endowment_for, get_or_create_market

# Pie's fixture: a budget of 160 tokens at 16 tokens per page endows 10 credits.
BUDGET_160_TOKENS = endowment_for(160, 16)


def report(capacity, contexts, device="gpu0", made=None, **extra):
    """A DeviceReport from rows (process, bid, pages, resident); context ids are 1, 2, ... in row order."""
    processes = list(dict.fromkeys([row[0] for row in contexts] + list(made or {})))
    return {
        "device": device,
        "capacity": capacity,
        "processes": processes,
        "owners": [processes.index(row[0]) for row in contexts],
        "contexts": list(range(1, len(contexts) + 1)),
        "bids": [row[1] for row in contexts],
        "pages": [row[2] for row in contexts],
        "resident": [row[3] for row in contexts],
        "made": [(made or {}).get(p, 0) for p in processes],
        **extra,
    }


def market_with(**endowments) -> Market:
    market = Market()
    for process, endowment in endowments.items():
        market.join(process, endowment)
    return market


def settle_one(market, *args, **kwargs):
    [decision] = market.settle([report(*args, **kwargs)])
    assert market.ledger().balanced
    return decision


def balance(market, process):
    return market.account(process)["balance"]


# -- ported from Pie's manager tests ----------------------------------------------------------------------------


def test_uncontended_device_charges_no_rent():
    market = market_with(p=BUDGET_160_TOKENS)
    decision = settle_one(market, 100, [("p", 2.0, 5, True)])
    assert decision == {"device": "gpu0", "price": 0.0, "suspend": [], "restore": [], "waiting": [], "caps": {"p": 2.0}}
    assert market.account("p")["rent"] == 0 and balance(market, "p") == 10


def test_waiter_that_does_not_fit_sets_the_price():
    """Pie: a waiting context makes the device contended and the price the lowest resident bid (2.0, revenue 10).
    Documented: the price is the waiter's own (highest excluded) bid, paid on every resident page."""
    market = market_with(p=BUDGET_160_TOKENS, w=BUDGET_160_TOKENS)
    decision = settle_one(market, 8, [("p", 2.0, 5, True), ("w", 1.5, 4, False)])
    assert decision["price"] == 1.5 and decision["waiting"] == [2] and decision["suspend"] == decision["restore"] == []
    assert market.account("p")["rent"] == 7.5
    # The revenue of 7.5 goes back to both processes in proportion to their equal endowments.
    assert balance(market, "p") == 10 - 7.5 + 3.75 and balance(market, "w") == 10 + 3.75


def test_full_device_without_waiters_charges_no_rent():
    """Pie charges the minimum resident bid on a full device (price 1.5, revenue 7.5); with the highest excluded bid
    as the price, a full device that excludes no one is uncontended."""
    market = market_with(p=BUDGET_160_TOKENS)
    assert settle_one(market, 5, [("p", 1.5, 5, True)])["price"] == 0
    assert balance(market, "p") == 10


def test_rent_moves_between_processes_under_contention():
    market = market_with(payer=1000, waiter=1000)
    decision = settle_one(market, 10, [("payer", 4.0, 8, True), ("waiter", 1.0, 4, False)])
    assert decision["price"] == 1.0
    # The payer pays 1 × 8 pages; each process gets 8 × 1000/2000 back.
    assert balance(market, "payer") == 1000 - 8 + 4 and balance(market, "waiter") == 1000 + 4
    assert market.account("waiter")["dividend"] == 4 and market.account("waiter")["rent"] == 0


def test_join_sets_balance_to_endowment():
    market = Market(default_endowment=BUDGET_160_TOKENS)
    assert market.join("budgeted", endowment_for(1000, 16)) == 63
    assert market.join("default") == 10
    assert market.account("budgeted")["balance"] == market.account("budgeted")["endowment"] == 63
    assert market.account("default")["balance"] == 10


def test_making_pages_costs_one_credit_each():
    """Pie never charged the make cost; the documented price() of 1 credit per new page is burned."""
    market = market_with(p=BUDGET_160_TOKENS)
    settle_one(market, 100, [("p", 0.0, 3, True)], made={"p": 3})
    assert balance(market, "p") == 10 - 3 * PAGE_COST
    assert market.ledger().burned == 3 * MICRO


def test_a_process_that_cannot_pay_loses_its_place_and_conservation_holds():
    """Pie lets a payer with 1 credit owe 50, takes its last credit and flags it defaulted. Here its bid of 10 per
    page counts as what it can afford, 1 credit / 5 pages = 0.2, so a bid of 3 takes its place at a price of 0.2."""
    market = market_with(poor=1, rich=1000)
    decision = settle_one(market, 5, [("poor", 10.0, 5, True), ("rich", 3.0, 5, False)])
    assert decision["suspend"] == [1] and decision["restore"] == [2] and decision["price"] == 0.2
    # rich pays 0.2 × 5 = 1 credit, shared back 1:1000 (in micro-credits, the leftover unit to the larger remainder).
    assert market.wallets.balance[market.wallets.slot("poor")] == MICRO + 999
    assert market.wallets.balance[market.wallets.slot("rich")] == 999 * MICRO + 999_001
    assert market.ledger().held == 1001 * MICRO


def test_a_token_budget_endows_one_credit_per_page_it_can_make():
    assert (BUDGET_160_TOKENS, endowment_for(1000, 16), endowment_for(0, 16)) == (10.0, 63.0, 0.0)
    assert endowment_for(None, 16) is None  # no budget: the market's default endowment


def test_caps_tell_the_replica_what_each_process_can_afford():
    market = market_with(rich=1000, broke=0)
    decision = settle_one(market, 4, [("rich", 1.0, 4, True), ("broke", 9.0, 4, False), ("stranger", 5.0, 2, False)])
    assert decision["caps"] == {"rich": 1000 / 4, "broke": 0.0, "stranger": 0.0}
    assert decision["waiting"] == [2, 3] and decision["price"] == 0.0  # capped bids of 0: nobody pays for them


def test_shared_prefix_rent_is_split_shapley_fairly():
    """Pie's example: A and B share a 4-page prefix; A adds 3 pages of its own, B 2. Their effective pages are 5 and
    4, and the rent of the 9 physical pages is paid exactly once."""
    market = market_with(a=1000, b=1000, c=1000)
    shared = 4 / 2
    settle_one(market, 9, [("a", 3.0, shared + 3, True), ("b", 3.0, shared + 2, True), ("c", 1.0, 2, False)])
    assert market.account("a")["rent"] == 5 and market.account("b")["rent"] == 4


# -- the documented clearing rule --------------------------------------------------------------------------------


def test_backfill_admits_a_smaller_lower_bidder_who_pays_its_own_bid():
    market = market_with(s=1000, a=1000, b=1000)
    decision = settle_one(market, 10, [("s", 3.0, 5, False), ("a", 2.0, 6, True), ("b", 1.0, 4, True)])
    # s fits (5 of 10); a (6) does not fit in the 5 left; b (4) does.
    assert {k: v for k, v in decision.items() if k != "caps"} == {
        "device": "gpu0",
        "price": 2.0,
        "suspend": [2],
        "restore": [1],
        "waiting": [],
    }
    assert decision["caps"] == {"s": 1000 / 5, "a": 1000 / 6, "b": 1000 / 4}
    assert market.account("s")["rent"] == 2.0 * 5 and market.account("b")["rent"] == 1.0 * 4


def test_suspended_contexts_come_back_highest_bid_first():
    market = market_with(p=1000)
    rows = [("p", 1.0, 3, False), ("p", 3.0, 3, False), ("p", 2.0, 3, False)]
    assert settle_one(market, 10, rows) == {
        "device": "gpu0",
        "price": 0.0,
        "suspend": [],
        "restore": [2, 3, 1],
        "waiting": [],
        "caps": {"p": 1000 / 9},
    }
    assert settle_one(market, 6, rows) == {
        "device": "gpu0",
        "price": 1.0,
        "suspend": [],
        "restore": [2, 3],
        "waiting": [1],
        "caps": {"p": 1000 / 9},
    }


def test_losers_are_suspended_lowest_bid_first():
    market = market_with(p=1000, q=1000)
    rows = [("p", 1.0, 2, True), ("p", 2.0, 2, True), ("q", 5.0, 4, False)]
    assert settle_one(market, 4, rows)["suspend"] == [1, 2]


def test_an_equal_bid_does_not_displace_a_resident_context():
    market = market_with(p=1000, q=1000)
    decision = settle_one(market, 5, [("q", 2.0, 5, False), ("p", 2.0, 5, True)])
    assert decision["suspend"] == decision["restore"] == [] and decision["waiting"] == [1] and decision["price"] == 2.0


def test_rent_is_per_tick():
    market = market_with(p=1000, q=1000)
    settle_one(market, 4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)], ticks=3)
    assert market.account("p")["rent"] == 1.0 * 4 * 3


def test_nan_and_negative_bids_count_as_zero():
    market = market_with(p=1000, q=1000)
    decision = settle_one(market, 4, [("p", float("nan"), 4, True), ("q", -3.0, 4, False)])
    assert decision["price"] == 0.0 and decision["waiting"] == [2]


# -- joining, leaving, reading ------------------------------------------------------------------------------------


def test_a_leaver_takes_its_balance_out_and_later_reports_of_it_pay_nothing():
    market = market_with(p=1000, q=1000)
    settle_one(market, 4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)])
    assert market.leave("p") == 1000 - 4 + 2
    ledger = market.ledger()
    assert ledger.returned == 998 * MICRO and ledger.held == 1002 * MICRO and ledger.balanced
    with pytest.raises(KeyError, match="has not joined"):
        market.account("p")
    # A report that still names p: its context bids nothing, so q's takes the device, and p pays no rent.
    decision = settle_one(market, 4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)], made={"p": 5})
    assert decision["suspend"] == [1] and decision["restore"] == [2] and decision["price"] == 0.0
    assert market.ledger() == ledger
    assert market.leave("p") == 0.0


def test_a_rejoining_slot_does_not_inherit_the_leavers_readings():
    market = market_with(p=1000, q=1000)
    settle_one(market, 4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)])
    market.leave("p")
    market.join("r", 50)
    account = market.account("r")
    assert account["rent"] == account["dividend"] == 0 and account["prices"] == {}


def test_account_reads_every_device():
    market = market_with(p=1000, q=1000)
    market.settle(
        [
            report(4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)], device="gpu0", latency_s=0.02),
            report(8, [("q", 1.0, 4, True)], device="gpu1", latency_s=0.01),
        ]
    )
    p, q = market.account("p"), market.account("q")
    assert p["prices"] == {"gpu0": 1.0} and p["latency"] == {"gpu0": 0.02}
    assert q["prices"] == {"gpu0": 1.0, "gpu1": 0.0} and q["latency"] == {"gpu0": 0.02, "gpu1": 0.01}
    assert p["rent"] == 4 and q["rent"] == 0 and p["dividend"] == q["dividend"] == 2 and p["page_cost"] == 1.0


def test_joining_twice_or_with_a_bad_endowment_is_refused():
    market = market_with(p=10)
    with pytest.raises(ValueError, match="already joined"):
        market.join("p", 10)
    for endowment in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="endowment"):
            market.join("q", endowment)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"device": ""}, "'device'"),
        ({"capacity": -1}, "capacity"),
        ({"capacity": None}, "capacity"),
        ({"processes": ["p", "p"]}, "twice"),
        ({"owners": [0, 3]}, "'owners'"),
        ({"bids": [1.0]}, "'bids' has shape"),
        ({"pages": [1.0, -2.0]}, "'pages'"),
        ({"pages": [1.0, float("inf")]}, "'pages'"),
        ({"made": [-1, 0]}, "'made'"),
        ({"ticks": -1}, "'ticks'"),
        ({"resident": None}, "missing resident"),
    ],
)
def test_a_bad_report_names_its_problem_and_changes_nothing(change, message):
    market = market_with(p=1000, q=1000)
    good = report(4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)], device="good", made={"p": 1})
    bad = {**report(4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)]), **change}
    if change == {"resident": None}:
        del bad["resident"]
    before = market.ledger()
    with pytest.raises(ValueError, match=message):
        market.settle([good, bad])
    assert market.ledger() == before and market.account("p")["prices"] == {}


# -- through Ray -------------------------------------------------------------------------------------------------


def test_the_market_actor_settles_numpy_reports(ray_session):
    ray = ray_session
    market = get_or_create_market(namespace="pie-test")
    try:
        ray.get([market.join.remote("p", 1000), market.join.remote("q", 1000)])
        rows = report(4, [("p", 2.0, 4, True), ("q", 1.0, 4, False)])
        arrays = {k: np.asarray(v) if isinstance(v, list) and k != "processes" else v for k, v in rows.items()}
        [decision] = ray.get(market.settle.remote([arrays]))
        assert decision == {
            "device": "gpu0",
            "price": 1.0,
            "suspend": [],
            "restore": [],
            "waiting": [2],
            "caps": {"p": 1000 / 4, "q": 1000 / 4},
        }
        same = get_or_create_market(namespace="pie-test")
        assert ray.get(same.account.remote("p"))["balance"] == 1000 - 4 + 2
        assert ray.get(same.ledger.remote()).balanced
        issued = ray.get(same.ledger.remote()).issued
        assert ray.get(same.join.remote("p", 5)) == 1000  # joining again (a call sent again after a restart):
        assert ray.get(same.ledger.remote()).issued == issued  # the wallet as it was, no credits issued twice
    finally:
        ray.kill(market)


def test_a_burst_of_wallets_through_wallet_calls_opens_and_closes_each_once(ray_session):
    """A host's burst of launches, coalesced into the market's batch calls (``test_coalesced_calls.py`` shows one
    call per loop turn): each caller hears its own endowment back, a join sent again changes nothing, and closing
    them all returns every credit."""
    ray = ray_session
    market = get_or_create_market(namespace="pie-test-wallets")
    calls = wallet_calls(market)
    assert wallet_calls(get_or_create_market(namespace="pie-test-wallets")) is calls  # one per market handle

    async def burst() -> tuple[list[float], list[float], float]:
        endowments = [None if i % 3 == 0 else float(10 + i) for i in range(24)]
        joined = await asyncio.gather(*(calls.join(f"w{i}", e) for i, e in enumerate(endowments)))
        again = await calls.join("w1", 999.0)
        left = await asyncio.gather(*(calls.leave(f"w{i}") for i in range(24)))
        return joined, left, again

    try:
        joined, left, again = asyncio.run(burst())
        expected = [DEFAULT_ENDOWMENT if i % 3 == 0 else 10.0 + i for i in range(24)]
        assert joined == expected and again == 11.0
        assert left == expected  # nobody held pages: every wallet closes with what it opened with
        ledger = ray.get(market.ledger.remote())
        assert ledger.balanced and ray.get(market.summary.remote()).wallets == 0
        assert ray.get(market.leave_many.remote(["w0", "never"])) == [0.0, 0.0]  # closing twice is harmless

        async def one_bad() -> tuple[list, float]:
            bad, good = calls.join("bad", -1.0), calls.join("good", 5.0)  # one batch
            return await asyncio.gather(bad, good, return_exceptions=True), await calls.leave("good")

        (bad, good), left = asyncio.run(one_bad())
        assert isinstance(bad, ValueError) and "endowment" in str(bad)  # its own answer, not the batch's failure
        assert good == 5.0 and left == 5.0
    finally:
        ray.kill(market)
