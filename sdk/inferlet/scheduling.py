"""The KV-page market as an inferlet sees it: its credits, the rent on its pages, what bidding costs.

Contexts bid credits per page per tick to stay resident when memory is short (``Context.set_bid``; ``Context.idle``
bids 0 for a scope; a ``Generator`` bids for its context by default, from ``default_bid``). The replica hears from the
market every round (50 ms), so these readings may be that stale; they are cached here for as long.
"""

from __future__ import annotations

import time

from inferlet.model import Model

PAGE_COST = 1.0  # credits per new KV page, burned when it is made
_FRESH_S = 0.05  # a reading younger than this is reused (the market's round period)


def balance(model: Model) -> float:
    """This inferlet's credits now."""
    return _account(model)["balance"]


def dividend(model: Model) -> float:
    """Credits this inferlet received in the latest round of each device (rent shared in proportion to endowment)."""
    return _account(model)["dividend"]


def rent(ctx) -> float:
    """Credits per page per tick on the context's device: the clearing price of its latest auction (0 when every
    context fits)."""
    return _account(ctx.model)["price"]


def latency(ctx) -> float:
    """Wall time of one tick (a batch) on the context's device, in seconds."""
    return _account(ctx.model)["latency"]


def price() -> float:
    """Credits per new KV page."""
    return PAGE_COST


def default_bid(
    balance: float, pages: float, expected_tokens: float, cv2: float, page_size: int, dividend: float
) -> float:
    """Pie's truthful bid per page per tick: what spends the balance (plus dividends) over the tokens still expected.

    Holding p pages for n more tokens costs rent on p·n + n(n−1)/(2s) page-ticks; with n of mean μ and squared
    coefficient of variation cv², that is about p·μ + μ²(1+cv²)/(2s). Bidding (B/μ + d) / (p + μ(1+cv²)/(2s)) spends
    B + n·d over them."""
    mu = max(expected_tokens, 1.0)
    numerator = balance / mu + dividend
    denominator = pages + mu * (1.0 + cv2) / (2.0 * page_size)
    return numerator / denominator if denominator > 0 else numerator


def readings(model: Model) -> dict | None:
    """The latest readings for ``model``'s replica (balance, endowment, dividend, paid: rent paid in the latest
    rounds, page_cost, price, latency), or None when that replica runs without a market."""
    now = time.monotonic()
    cached = getattr(model, "_market_readings", None)
    if cached is None or now - cached[0] > _FRESH_S:
        cached = model._market_readings = (now, model.channel.call_sync("account"))
    return cached[1]


def _account(model: Model) -> dict:
    got = readings(model)
    if got is None:
        raise RuntimeError(
            f"model {model.name!r} is served without the KV-page market (a bare replica, not `pie run` or a Pie "
            "cluster): there are no credits to read"
        )
    return got
