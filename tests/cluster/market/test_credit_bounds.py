"""Credits are set by the trusted side and bounded (``[limits] max_endowment``): a launch's token budget, however
large, endows at most that many credits (its tokens are still limited by the whole budget, where its passes run),
so no user can mint credits that would buy every page and take the dividends of every other user's rent."""

from __future__ import annotations

import asyncio
import uuid

import ray
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.market import MICRO, endowment_for, get_or_create_market


def test_a_huge_token_budget_endows_no_more_than_the_bound(ray_session):
    market = get_or_create_market(f"pie-test-credits-{uuid.uuid4().hex[:6]}", max_endowment=100.0)
    try:
        before = ray.get(market.ledger.remote())
        huge = endowment_for(10**12, 16)  # the largest budget a launch request takes

        async def open_wallets():
            calls = wallet_calls(market)  # as the host that runs an instance opens its wallet
            return await asyncio.gather(calls.join("alice-1", huge), calls.join("bob-1", 10.0))

        alice, bob = asyncio.run(open_wallets())
        ledger = ray.get(market.ledger.remote())
        accounts = ray.get(market.accounts.remote(["alice-1", "bob-1"]))
    finally:
        ray.kill(market)
    assert (alice, bob) == (100.0, 10.0)
    assert ledger.issued - before.issued == 110 * MICRO
    assert accounts["alice-1"]["endowment"] == 100.0 and accounts["bob-1"]["endowment"] == 10.0
