"""The KV-page market as an inferlet sees it: its credits, the rent on its pages, what bidding costs.

Contexts bid credits per page per tick to stay resident when memory is short (``Context.set_bid``; ``Context.idle``
bids 0 for a scope; a ``Generator`` bids for its context by default, from ``default_bid``). The replica hears from the
market every round (50 ms), so these readings may be that stale; they are cached here for as long.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from pie_workers.wire.messages import AccountReply, decode

from inferlet import runtime
from inferlet.model import Model

PAGE_COST = 1.0  # credits per new KV page, burned when it is made
_FRESH_S = 0.05  # a reading younger than this is reused (the market's round period)
_OPENING_S = 0.5  # how long a new inferlet may bid from its wallet's opening balance while its reading is on the way


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
    cache = _Readings.of(model)
    if cache.stale():
        cache.store(model.link.call_sync("account"))
    return cache.latest


async def step_readings(model: Model) -> dict | None:
    """``readings`` for a Generator's every step, never holding up the other inferlets of this process: the first
    one is awaited, later ones are what is cached, refreshed in the background once stale (so up to two rounds
    old)."""
    cache = _Readings.of(model)
    if cache.latest is None and cache.stale():
        opening = _opening_readings()
        if opening is None:
            cache.store(await model.link.call("account"))
            return cache.latest
        if opening[1] > _FRESH_S and cache.refreshing is None:
            cache.refreshing = asyncio.ensure_future(cache.refresh(model))
        return opening[0]
    if cache.stale() and cache.refreshing is None:
        cache.refreshing = asyncio.ensure_future(cache.refresh(model))
    return cache.latest


def _opening_readings() -> tuple[dict, float] | None:
    """What a wallet opened moments ago holds, and its age: a new inferlet's first steps bid from it rather than
    wait for the replica to ask the market (a round trip before its first pass). Exact until the first round that
    names it; used for up to ``_OPENING_S``, refreshed in the background after one round period."""
    try:
        current = runtime.current()
    except RuntimeError:  # a model used outside an inferlet run
        return None
    if current.opening_balance is None:
        return None
    age = time.monotonic() - current.opened_at
    if age > _OPENING_S:
        return None
    balance = current.opening_balance
    return {"balance": balance, "endowment": balance, "dividend": 0.0, "paid": 0.0}, age


class _Readings:
    """One model's cached readings; a replica without a market is asked once."""

    def __init__(self) -> None:
        self.latest: dict | None = None
        self.at = -math.inf
        self.market = True  # until the replica says otherwise
        self.refreshing: asyncio.Future | None = None

    @staticmethod
    def of(model: Model) -> _Readings:
        if model.market_readings is None:
            model.market_readings = _Readings()
        return model.market_readings

    def stale(self) -> bool:
        return self.market and time.monotonic() - self.at > _FRESH_S

    def store(self, answer: dict | None) -> None:
        """Keep an ``account`` answer (an ``AccountReply`` on the wire; None: the replica has no market)."""
        self.latest = None if answer is None else dataclasses.asdict(decode(AccountReply, answer))
        self.at, self.market = time.monotonic(), answer is not None

    async def refresh(self, model: Model) -> None:
        try:
            self.store(await model.link.call("account"))
        except Exception:  # the inferlet is ending (its channel closed): the cached readings stay
            pass
        finally:
            self.refreshing = None


def _account(model: Model) -> dict:
    got = readings(model)
    if got is None:
        raise RuntimeError(
            f"model {model.name!r} is served without the KV-page market (a bare replica, not `pie run` or a Pie "
            "cluster): there are no credits to read"
        )
    return got
