"""The replica's counters as the trusted side reads them (``pie status``, benchmarks, tests), over Ray: a record, so
a reader names what it reads. An inferlet's own session reads a narrower dict over the wire (``op_stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """One replica engine's pages, contexts, queue and work done since it started."""

    free: int  # pages: free + working + committed + cached == total (``PageStats``)
    working: int
    committed: int
    cached: int
    total: int
    contexts: int
    snapshots: int  # held here (others may be named in the directory)
    queued: int  # requests waiting for a batch
    suspended: int  # contexts whose pages were given up
    suspensions: int
    offloaded: int  # suspensions whose pages went to host memory
    waiting: int  # contexts in line for memory
    batches: int
    requests: int
    prefix_hit_tokens: int  # prompt tokens taken from the prefix trie instead of computed
    chained: int  # passes that ran on the token their predecessor sampled
    ahead: int  # steps run before they were asked for
    ahead_taken: int  # ... that a request then adopted
    market_rounds: int  # 0 without a market
    price: float  # the device's clearing price per page (0.0 without a market)
    moved_out: int = 0  # contexts and snapshots handed to another replica with their KV (``handover.py``)
    moved_in: int = 0  # ... adopted from a replica that left
    claimed: int = 0  # adopted contexts their inferlets took up here
    unnotified: int = 0  # inferlet sessions whose contexts moved away that have not been told yet
