"""The KV-page market: wallets, per-device second-price knapsack auctions, rent, dividends (rules in ``market.py``)."""

from pie_cluster.market.actor import MARKET_NAME, MarketActor, MarketSummary, get_or_create_market
from pie_cluster.market.auction import Clearing, clear
from pie_cluster.market.market import DEFAULT_ENDOWMENT, PAGE_COST, Market, endowment_for
from pie_cluster.market.wallets import MICRO, Ledger
from pie_cluster.market.wire import Account, DeviceDecision, DeviceReport

__all__ = [
    "DEFAULT_ENDOWMENT",
    "MARKET_NAME",
    "MICRO",
    "PAGE_COST",
    "Account",
    "Clearing",
    "DeviceDecision",
    "DeviceReport",
    "Ledger",
    "Market",
    "MarketActor",
    "MarketSummary",
    "clear",
    "endowment_for",
    "get_or_create_market",
]
