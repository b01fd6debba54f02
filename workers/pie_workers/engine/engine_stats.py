"""The replica's counters as the trusted side reads them (``pie status``, benchmarks, tests), over Ray: a record, so
a reader names what it reads. An inferlet's own session reads a narrower dict over the wire (``op_stats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie_workers.engine.service import ReplicaEngine


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


def read_stats(engine: ReplicaEngine) -> EngineStats:
    """``engine``'s numbers now, on its event loop."""
    s, table = engine.store.stats(), engine.contexts.stats()
    steps = engine.passes.steps
    return EngineStats(
        free=s.free,
        working=s.working,
        committed=s.committed,
        cached=s.cached,
        total=s.total,
        contexts=table.contexts,
        snapshots=table.snapshots,
        queued=engine.scheduler.queued,
        suspended=sum(state.suspended is not None for state in engine.records),
        suspensions=engine.residency.suspensions,
        offloaded=engine.residency.offloaded,
        waiting=engine.residency.waiting,
        batches=engine.scheduler.batches_fired,
        requests=engine.scheduler.requests_served,
        prefix_hit_tokens=engine.passes.prefix_hit_tokens,
        chained=steps.chained_passes,
        ahead=steps.steps_ahead,
        ahead_taken=steps.steps_ahead_taken,
        market_rounds=engine.market.rounds if engine.market else 0,
        price=engine.market.price if engine.market else 0.0,
        moved_out=engine.handovers.moved_out,
        moved_in=engine.handovers.moved_in,
        claimed=engine.handovers.claimed,
        unnotified=len(engine.handovers.unnotified),
    )
