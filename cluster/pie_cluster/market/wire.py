"""The messages between replicas, the SDK and the market.

They are TypedDicts — ordinary dicts at run time — because replicas and the SDK never import ``pie_cluster`` (the
dependency arrow points from cluster to workers), and a dict of strings, numbers and lists or numpy arrays crosses
Ray and msgpack as it is. Per-context fields accept lists or numpy arrays (``bench/market.py`` measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NotRequired, TypedDict


class DeviceReport(TypedDict):
    """One device's contexts for one market round (one report per device per round, all contexts at once)."""

    device: str
    """A KV pool, e.g. ``"replica-key/rank0"``."""
    capacity: float
    """Pages the device can keep resident for contexts."""
    processes: Sequence[str]
    """The distinct processes (inferlet instance ids) this report mentions."""
    owners: Sequence[int]
    """Per context: its process, as an index into ``processes``."""
    contexts: Sequence[int]
    """Per context: the replica's context id, echoed back in the decision."""
    bids: Sequence[float]
    """Per context: credits per page per tick (NaN and negative bids count as 0)."""
    pages: Sequence[float]
    """Per context: effective pages — exclusive pages plus, for each shared page, 1/(number of holders)."""
    resident: Sequence[bool]
    """Per context: holds its pages on the device now (else suspended and waiting to come back)."""
    made: NotRequired[Sequence[int]]
    """Per process (aligned with ``processes``): new pages it made on this device since its previous report."""
    ticks: NotRequired[int]
    """Device ticks (fired batches) this round stands for; rent is per page per tick. Default 1; 0 settles only
    make cost (a replica does so when an inferlet ends, before its wallet closes)."""
    latency_s: NotRequired[float]
    """Recent wall time of one device tick, passed on to ``scheduling.latency``. Default 0."""


class DeviceDecision(TypedDict):
    """The outcome of one device's round, for the replica to apply."""

    device: str
    price: float
    """Clearing price, credits per page per tick: the highest excluded bid, 0 when everything fits."""
    suspend: list[int]
    """Resident contexts that lost: suspend them (lowest bid first)."""
    restore: list[int]
    """Suspended contexts that won: restore them in this order (highest bid first) once the losers' pages are free."""
    waiting: list[int]
    """Suspended contexts that stay suspended, highest bid first: the order to restore them in if memory frees up
    before the next round."""
    caps: dict[str, float]
    """Per process of the report: the highest bid per page it can afford this round (absent: no limit); the replica
    caps its contexts' bids with it until the next round."""


class Account(TypedDict):
    """What ``inferlet.scheduling`` reads for one process; amounts in credits."""

    balance: float
    endowment: float
    rent: float
    """Paid in the latest round of each device where the process has contexts, summed over those devices."""
    dividend: float
    """Received from the latest round of every device, summed."""
    page_cost: float
    """``scheduling.price()``: credits per new page."""
    prices: dict[str, float]
    """Clearing price of each device where the process has contexts (``scheduling.rent``)."""
    latency: dict[str, float]
    """Reported tick wall time, in seconds, of each of those devices (``scheduling.latency``)."""
