"""Where the ingress's requests spend their time, as Prometheus histograms on ``/metrics``.

Labelled by route (``chat``, ``completions``, ``responses``, ``instances``) and model, so an operator tells the
framework's time from the engine's:

* ``pie_request_queue_seconds``: from arrival until the instance may run (its admission slot: one free in the
  ingress's lease, or the launcher's answer, waiting in its queue included; an uploaded program's launch);
* ``pie_request_start_seconds``: from arrival until the program's ``main`` runs (its slot, services and market
  wallet; measured for the programs the ingress runs itself);
* ``pie_request_first_pass_seconds``: from arrival until the replica answered the program's first pass that
  generated (the prefill; measured for the programs the ingress runs itself): first token less first pass is the
  way back from the replica to the client;
* ``pie_request_first_token_seconds``: from arrival until the first generated text leaves (the prefill pass and
  everything before it);
* ``pie_request_stream_seconds``: from the first token until the last event (decoding);
* ``pie_request_seconds``: from arrival until the last event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, Histogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class RequestClock:
    """The moments of one request, marked as it goes (``time.perf_counter`` seconds)."""

    route: str
    model: str
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    started: float | None = None  # its program's main began (None: it ran elsewhere, on a node's host)
    first_pass: float | None = None  # a pass first generated for it (None: it ran elsewhere, or never generated)
    first_token: float | None = None
    ended: float | None = None

    def mark_admitted(self) -> None:
        self.admitted = time.perf_counter()

    def mark_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def mark_ended(self) -> None:
        if self.ended is None:
            self.ended = time.perf_counter()


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry):
        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, ["route", "model"], buckets=BUCKETS, registry=registry)

        self._queue = histogram("pie_request_queue_seconds", "arrival until the instance may run (admission)")
        self._start = histogram("pie_request_start_seconds", "arrival until the program's main runs")
        self._first_pass = histogram("pie_request_first_pass_seconds", "arrival until the first generating pass")
        self._first_token = histogram("pie_request_first_token_seconds", "arrival until the first generated text")
        self._stream = histogram("pie_request_stream_seconds", "first generated text until the last event")
        self._total = histogram("pie_request_seconds", "arrival until the last event")

    def observe(self, clock: RequestClock) -> None:
        """Record what the request's clock marked; a request that failed before a mark records nothing past it."""
        labels = (clock.route, clock.model)
        if clock.admitted is not None:
            self._queue.labels(*labels).observe(clock.admitted - clock.arrived)
            if clock.started is not None:
                self._start.labels(*labels).observe(clock.started - clock.arrived)
        if clock.first_pass is not None:
            self._first_pass.labels(*labels).observe(clock.first_pass - clock.arrived)
        if clock.first_token is not None:
            self._first_token.labels(*labels).observe(clock.first_token - clock.arrived)
            if clock.ended is not None:
                self._stream.labels(*labels).observe(clock.ended - clock.first_token)
        if clock.ended is not None:
            self._total.labels(*labels).observe(clock.ended - clock.arrived)


class ScalingGauges:
    """Each autoscaled model's replicas now (``pie_model_replicas``) and its autoscaler's target
    (``pie_model_target_replicas``), as the controller reports them (``ModelScale`` records)."""

    def __init__(self, registry: CollectorRegistry):
        self._current = Gauge("pie_model_replicas", "an autoscaled model's replicas", ["model"], registry=registry)
        self._target = Gauge("pie_model_target_replicas", "its autoscaler's target", ["model"], registry=registry)

    def set(self, scales) -> None:
        for scale in scales:
            self._current.labels(scale.model).set(scale.current)
            self._target.labels(scale.model).set(scale.target)
