"""Steps that run without a round trip to the inferlet between them: a chained pass's further steps, and the step
run ahead of a plain pass (see ``wire.messages.PassRequest``).

Both take the token the step before sampled as their input and go straight into the next batch from the callback
that settles the step before, holding the context's gate all along. A chained pass's steps record their tokens as
they go but commit pages only when the pass ends, so that a failed step can undo the steps before it. A step run
ahead writes KV past the context's end, where nothing reads it, until a request that repeats it adopts it; anything
else on the context drops it.

``Steps`` decides and settles each step; ``Passes`` sends them and answers the pass, so neither calls the other
back.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from pie_workers.engine.channel import Answer
from pie_workers.engine.contexts import ContextTable
from pie_workers.engine.gate import Gate
from pie_workers.engine.protocol import PLAIN_PASS, PassBinding, one_step
from pie_workers.engine.record import EngineContext
from pie_workers.engine.residency import Residency, pages_to_reserve
from pie_workers.engine.scheduler import BatchScheduler
from pie_workers.engine.settle import commit_full, trim
from pie_workers.wire.batch import ForwardRequest, RequestOutput
from pie_workers.wire.codec import output_to_wire
from pie_workers.wire.messages import PassReply, PassRequest
from pie_workers.wire.pages import pages_for


@dataclass(slots=True, eq=False)
class StepAhead:
    """A step run before the inferlet asked for it: the next step of a plain pass, on the token that pass sampled,
    with the same samplers and probes."""

    request: ForwardRequest  # the step as it ran: that token at the next position, over the context as it was
    slots: list  # the pass's slots on the wire, as a request for this step carries them
    out: RequestOutput | Exception | None = None  # None while its batch runs

    def repeats(self, a: PassRequest) -> bool:
        return (
            a.plain()
            and a.tokens == self.request.token_ids
            and a.positions == self.request.positions
            and a.slots == self.slots
            and isinstance(self.out, RequestOutput)
            and self.out.error is None
        )


@dataclass(slots=True, eq=False)
class ChainedSteps:
    """A chained pass past its first step: what each further step reuses, and the context as the last step left it
    (only this pass changes the context while it holds the context's gate)."""

    record: EngineContext
    a: PassRequest
    answer: Answer
    slots: list
    bind: PassBinding
    walk: list[int]  # every step's token so far
    left: int  # steps still to run
    position: int  # the next step's input position
    token: int  # the next step's input
    page_ids: list[int]  # the context's pages, as the batch takes them
    seq_len: int


class Steps:
    def __init__(self, table: ContextTable, scheduler: BatchScheduler, residency: Residency):
        self.table = table
        self.scheduler = scheduler
        self.residency = residency
        self.page_size = self.table.page_size
        self.chained_passes = 0  # passes that ran on the token their predecessor sampled
        self.steps_ahead = 0  # steps run before they were asked for
        self.steps_ahead_taken = 0  # ... that a request then adopted

    # -- chained steps -----------------------------------------------------------------------------------------------

    def chained_input(self, a: PassRequest, sampled: int | None) -> list[int] | None:
        """A chained pass's input: the token its predecessor sampled; None when that is a stop id (nothing runs)."""
        if sampled is None:
            raise ValueError(
                f"context {a.ctx}: a chained pass follows the previous one, which failed or sampled no token"
            )
        if sampled in a.stop_ids:
            return None
        self.chained_passes += 1
        return [sampled]

    def chain(
        self, record: EngineContext, a: PassRequest, answer: Answer, slots: list, bind: PassBinding, walk: list[int]
    ) -> ChainedSteps:
        """The further steps of chained pass ``a``, whose first step sampled ``walk[-1]``."""
        view = self.table.view(record.id)
        return ChainedSteps(
            record=record,
            a=a,
            answer=answer,
            slots=slots,
            bind=bind,
            walk=walk,
            left=a.steps - 1,
            position=a.positions[0] + 1,
            token=walk[-1],
            page_ids=list(view.page_ids),
            seq_len=view.seq_len,
        )

    def next_step(self, run: ChainedSteps) -> ForwardRequest | PassRequest:
        """A chained pass's next step, on the token the step before sampled. The plain case (the context resident,
        no suspension due, its pages at hand) is a request made of what the pass already knows; anything else is
        the rest of the pass as a pass of its own, to go the general way, holding back the pages of the steps so
        far."""
        record = run.record
        need = pages_for(run.seq_len + 1, self.page_size) - len(run.page_ids)
        residency = self.residency
        if record.deferred or record.suspended is not None or (need > 0 and not residency.try_now(record, need)):
            return dataclasses.replace(run.a, positions=[run.position], steps=run.left, hold=run.a.hold + len(run.walk))
        if need > 0:
            run.page_ids = run.page_ids + residency.grant(record, need)
        record.sampled = None  # this step consumes it
        residency.touch(record)
        self.chained_passes += 1
        return one_step(run.token, run.position, run.page_ids, run.seq_len, run.slots, run.a.logit_mask, run.bind)

    def step_ended(self, run: ChainedSteps, out: RequestOutput | Exception) -> PassReply | None:
        """Settle a step ``next_step`` made: record its token; None if a next step is due, else the pass's answer
        (its full pages committed, as ``settle`` would, only now: a failed step undoes the steps before it)."""
        record = run.record
        if isinstance(out, Exception):
            raise out
        if out.error is not None:
            raise ValueError(out.error)
        self.table.record(record.id, [run.token], [run.position], run.bind.salt)
        if record.drafts is not None:
            record.drafts.extend([run.token])
        run.seq_len += 1
        sampled = next((s.token for s in out.slots if s.token is not None), None)
        run.left -= 1
        run.position += 1
        if sampled is not None:
            record.sampled = run.token = sampled
            run.walk.append(sampled)
            if run.left and sampled not in run.a.stop_ids:
                self.residency.wake()  # a waiter may find room now (as between single passes)
                return None
        commit_full(self.table, record.id, run.a.hold)
        slots = [output_to_wire(s) for s in out.slots]
        return PassReply(slots=slots, walk=run.walk, seq_len=run.seq_len, next_drafts=[])

    # -- the step run ahead ------------------------------------------------------------------------------------------

    def run_ahead(self, record: EngineContext, a: PassRequest, slots: list) -> bool:
        """Run the next step of a plain pass that asked for it, holding the context's gate until its batch ends;
        False (nothing runs) when the pass is not plain, sampled a stop id, or the step would wait for a page."""
        sampled = record.sampled
        last = len(a.tokens) - 1
        if (
            not a.plain()
            or sampled is None
            or sampled in a.stop_ids
            or any(row != last for row, _ in a.slots)
            or record.deferred
            or record.suspended is not None
        ):
            return False
        view = self.table.view(record.id)
        if need := pages_to_reserve(view, 1):
            if not self.residency.try_now(record, need):
                return False
            self.residency.grant(record, need)
            view = self.table.view(record.id)
        request = one_step(
            sampled,
            a.positions[-1] + 1,
            list(view.page_ids),
            view.seq_len,
            [(0, s) for _, s in slots],
            None,
            PLAIN_PASS,
        )
        ahead = record.ahead = StepAhead(request, [[0, s] for _, s in a.slots])
        self.steps_ahead += 1
        self.scheduler.submit_then(request, functools.partial(self._ahead_ended, ahead, record.gate))
        return True

    def _ahead_ended(self, ahead: StepAhead, gate: Gate, out: RequestOutput | Exception) -> None:
        ahead.out = out
        gate.give()  # to the request for this step, when it came meanwhile
        self.residency.wake()

    def take_ahead(self, record: EngineContext, a: PassRequest | None = None) -> StepAhead | None:
        """Take the context's step run ahead off it: the step, with its output, if pass ``a`` repeats it and it
        still fits the context (a suspension since changes that), else None, giving back a page only it used."""
        ahead, record.ahead = record.ahead, None
        if ahead is None or record.suspended is not None:
            return None
        if a is not None and ahead.repeats(a) and self.table.seq_len(record.id) == ahead.request.kv_len:
            self.steps_ahead_taken += 1
            return ahead
        trim(self.table, record.id)
        return None
