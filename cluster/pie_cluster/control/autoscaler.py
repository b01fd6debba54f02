"""How many replicas each model should have: a target per model, from what its replicas report, with hysteresis.

The load of a model is its replicas' live contexts (one per running generation, an idle inferlet's too), each
counted once whether it is running a pass or waiting for a batch, as Serve counts each request running or queued at
its replicas once; averaged over the last ``load_window_s`` of readings as Serve averages over its look-back
period (a reading alone is noise: requests of a second come and go between two readings);
``[[model]] target_load`` of it per replica is the aim, so the wanted count is ``ceil(load / target_load)``, within
``min_replicas`` and ``max_replicas``. Memory is the other signal, the one only
this cluster has: a replica that suspended contexts (the market gave their pages to higher bids) is short of KV
pages, whatever its load, so one more replica is wanted while any is suspended. A wanted count must hold for
``upscale_delay_s`` (more) or ``downscale_delay_s`` (fewer) before it becomes the target, as in Serve's autoscaler:
a burst shorter than the delay moves nothing. The controller (``control.scaling``) then adds or removes replicas
until the count meets the target.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pie_cluster.config import ModelConfigEntry


@dataclass(frozen=True)
class ReplicaLoad:
    """What one serving replica reports (``EngineStats``)."""

    contexts: int
    suspended: int


@dataclass(frozen=True)
class ModelScale:
    """One model's target, and why it is what it is (``pie status``; saved with the controller's state)."""

    model: str
    min_replicas: int
    max_replicas: int
    target: int
    current: int = 0  # replicas serving or being replaced now (filled in by the status)
    reason: str = "started"


class ScalePolicy:
    """One model's target over time: ``decide`` with each round's loads."""

    def __init__(self, entry: ModelConfigEntry, scale: ModelScale):
        self.entry, self.scale = entry, scale
        self._wanted_since: float | None = None  # when the wanted count first differed from the target
        self._wanted_way = 0  # +1: more, -1: fewer
        self._readings: deque[tuple[float, int]] = deque()  # (when, load) within the load window

    def decide(self, loads: list[ReplicaLoad], now: float) -> ModelScale:
        """The target after this round (``now``: a monotonic clock, seconds)."""
        entry, target = self.entry, self.scale.target
        wanted, why = self._wanted(loads, now)
        way = (wanted > target) - (wanted < target)
        if way == 0 or way != self._wanted_way:
            self._wanted_since, self._wanted_way = (None, 0) if way == 0 else (now, way)
        delay = entry.upscale_delay_s if way > 0 else entry.downscale_delay_s
        if way != 0 and now - self._wanted_since >= delay:
            held = f" for {delay:g} s" if delay else ""
            self.scale = ModelScale(entry.name, entry.fewest, entry.most, wanted, reason=f"{why}{held}")
            self._wanted_since, self._wanted_way = None, 0
        return self.scale

    def _wanted(self, loads: list[ReplicaLoad], now: float) -> tuple[int, str]:
        entry = self.entry
        self._readings.append((now, sum(r.contexts for r in loads)))
        while now - self._readings[0][0] > entry.load_window_s:
            self._readings.popleft()
        load = sum(reading for _, reading in self._readings) / len(self._readings)
        wanted = math.ceil(round(load, 6) / entry.target_load)
        over = f", mean over {entry.load_window_s:g} s" if entry.load_window_s else ""
        why = f"load {round(load, 1):g} (live contexts{over}) at {entry.target_load:g} per replica"
        suspended = sum(r.suspended for r in loads)
        if suspended and len(loads) + 1 > wanted:
            wanted, why = len(loads) + 1, f"KV memory short: {suspended} contexts suspended on {len(loads)} replicas"
        bounded = min(max(wanted, entry.fewest), entry.most)
        if bounded != wanted:
            why += f"; {'min' if bounded > wanted else 'max'}_replicas {bounded}"
        return bounded, why
