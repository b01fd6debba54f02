"""``Generation``: one generation's state — its settings, stop set, constraints and counters — and the two things
every step does with it: build the step's pass (``step_pass``, the one definition of a decode step), and fold the
tokens it produced back in (``fold``). Stepping (``generator.py``) and the collectors' chained passes
(``chained.py``) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pie_workers.wire.pages import pages_for

from inferlet import scheduling
from inferlet.adapter import Adapter
from inferlet.constraints import ConstraintSet
from inferlet.forward import Forward, SampleHandle
from inferlet.sampler import Probe, Sampler

if TYPE_CHECKING:
    from inferlet.context import Context


@dataclass(eq=False)
class Generation:
    ctx: Context
    sampler: Sampler
    constraints: ConstraintSet
    stop: set[int]  # tokens that end generation (not kept)
    max_tokens: int | None = None
    horizon: int | None = None  # the expected output length, for the default bid
    adapter: Adapter | None = None
    zo_seed: int | None = None
    step_probes: list[tuple[int, Probe]] = field(default_factory=list)  # attached to every step
    generated: int = 0
    done: bool = False
    bid_basis: dict | None = None  # the market readings the latest default bid was made from

    @property
    def is_done(self) -> bool:
        return self.done or (self.max_tokens is not None and self.generated >= self.max_tokens)

    def more_than_one_left(self) -> bool:
        return self.max_tokens is None or self.max_tokens - self.generated > 1

    async def step_pass(
        self, tokens: list[int] | None, position: int, probes: list[tuple[int, Probe]], sample: bool = True
    ) -> tuple[Forward, SampleHandle | None]:
        """A step's pass: ``tokens`` from ``position`` on (None: the token the replica supplies, for the caller to
        ``chain``), under the generation's adapter, with ``probes`` counted from the row that predicts the next
        token, the auto sampler there (unless not ``sample``), and this step's default bid."""
        fwd = Forward(self.ctx)
        last = 0
        if tokens is not None:
            fwd.input_at(tokens, list(range(position, position + len(tokens))))
            last = len(tokens) - 1
        if self.adapter is not None:
            fwd.adapter(self.adapter)
        if self.zo_seed is not None:
            fwd.zo_seed(self.zo_seed)
        for idx, probe in probes:
            fwd.probe(last + idx, probe)
        auto = fwd.sample([last], self.sampler) if sample else None
        bid = await self.default_bid()
        if bid is not None and self.ctx.adopt_default_bid(bid):
            fwd.bid(bid)  # rides in the forward request, set before its pages are reserved
        return fwd, auto

    async def default_bid(self) -> float | None:
        """This step's bid (Pie's rule), unless the inferlet set one or is idle; None without a market.

        The tokens still expected: ``horizon`` minus those generated (exactly), else ``max_tokens`` minus them
        (cv² = 1), else as many as generated so far, at least 64 (the Lindy rule)."""
        ctx = self.ctx
        if not ctx.bids_by_default:
            return None
        readings = self.bid_basis = await scheduling.step_readings(ctx.model)
        if readings is None:
            return None
        if self.horizon is not None:
            expected, cv2 = self.horizon - self.generated, 0.0
        elif self.max_tokens is not None:
            expected, cv2 = self.max_tokens - self.generated, 1.0
        else:
            expected, cv2 = max(self.generated, 64), 1.0
        pages = max(pages_for(ctx.seq_len, ctx.page_size), 1)
        return scheduling.default_bid(readings["balance"], pages, expected, cv2, ctx.page_size, readings["dividend"])

    def fold(self, tokens: list[int], in_kv: int = 0) -> tuple[list[int], int]:
        """Reconcile with the constraints, apply stop tokens and ``max_tokens``, and count the survivors.

        The first ``in_kv`` tokens (accepted drafts) already have KV. Afterwards KV and buffer are what a run without
        drafts leaves: every survivor is in the KV but the last, which is queued as the next step's input — unless
        a stop token ended generation, whose step flushed them all. Returns the survivors and how many in-KV tokens
        must be truncated for that.
        """
        kept: list[int] = []
        stopped = False
        for t in self.constraints.admit(tokens):
            if t in self.stop:
                self.done = stopped = True
                break
            kept.append(t)
        if self.max_tokens is not None:
            room = self.max_tokens - self.generated
            if len(kept) >= room:
                kept, self.done = kept[:room], True
        self.generated += len(kept)
        stays = max(0, min(len(kept) if stopped else len(kept) - 1, in_kv))
        self.ctx.append(kept[stays:])
        if not self.done and self.constraints and self.constraints.terminated:
            self.done = True
        return kept, in_kv - stays
