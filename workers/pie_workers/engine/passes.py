"""A forward pass, from the request that asks for it to the pages it leaves settled.

A pass waits for its context's gate, then reserves the pages it needs, runs in a batch, and settles: it records
lineage for what it wrote (inputs plus the drafts the model accepted — rejected drafts are rolled back here, so KV,
``seq_len`` and lineage always agree), commits every full page to the prefix trie but those touching its last
``hold`` tokens, and gives back pages it left empty (``settle.py``).

The common pass (a resident context, no prefix lookup, no prefill chunking, its pages at hand) takes the fast path:
it goes straight into the next batch and settles the moment the batch ends, with no task and no wake-ups, so the
next step's request finds the gate free. Any other pass continues as a task (``_pass_slowly``): it restores a
suspended context, adopts cached prefix pages on a context's first pass, splits a long prefill into chunks and waits
in line for pages. Chained steps and steps run ahead are decided and settled in ``steps.py``; they are sent and
answered here.

KV written under a custom attention mask or a zo seed is salted per context, so the prefix trie never shares it;
KV written under an adapter is salted with the adapter's current weights, so only passes with the same adapter
share it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections import Counter
from collections.abc import Callable

from pie_workers.engine import ngram
from pie_workers.engine.adapter_registry import AdapterRegistry
from pie_workers.engine.channel import Answer
from pie_workers.engine.protocol import PLAIN_PASS, PassBinding, forward_request
from pie_workers.engine.record import EngineContext, EngineContexts
from pie_workers.engine.residency import Residency, pages_to_reserve
from pie_workers.engine.scheduler import BatchScheduler, prefill_chunks
from pie_workers.engine.settle import settle, truncate
from pie_workers.engine.steps import ChainedSteps, Steps
from pie_workers.engine.token_budget import TokenBudgets
from pie_workers.wire.batch import ForwardRequest, RequestOutput
from pie_workers.wire.codec import output_to_wire, slot_from_wire
from pie_workers.wire.messages import PassReply, PassRequest, encode

log = logging.getLogger(__name__)


class Passes:
    def __init__(
        self, records: EngineContexts, scheduler: BatchScheduler, residency: Residency, adapters: AdapterRegistry
    ):
        """``records``: the engine's live contexts (read only: a context missing from it was destroyed)."""
        self.records = records
        self.contexts = records.table
        self.scheduler = scheduler
        self.residency = residency
        self.adapters = adapters
        self.page_size = records.table.page_size
        self.steps = Steps(records.table, scheduler, residency)
        self.budgets = TokenBudgets()  # each instance's tokens against its capability's budget
        self._slow_passes: set[asyncio.Task] = set()
        self.prefix_hit_tokens = 0  # prompt tokens taken from the prefix trie instead of computed (engine stats)
        self.prefix_hits: Counter[str] = Counter()  # the same by user: what a user's own ``stats`` reads

    # -- a pass's course -----------------------------------------------------------------------------------------

    def start(self, state: EngineContext, a: PassRequest, answer: Answer, walk: list[int] | None = None) -> None:
        """The context's turn has come (this holds its gate): send the pass down the fast path, answer it from the
        step run ahead that it repeats, or continue it as a task. ``walk``: the tokens of a chained pass's steps
        before this one."""
        ctx = a.ctx
        try:
            tokens = self._input(state, a)
            if tokens is None:
                return self.end(state, answer, None)
            a = self.budgets.bound(state.session, a, walk)
            bind = self._binding(state, a)
            slots = [(int(row), slot_from_wire(s)) for row, s in a.slots]
            if (ahead := self.steps.take_ahead(state, a)) is not None:
                return self._settle_start(state, a, answer, walk, ahead.request, bind, ahead.out)
            new_tokens = len(tokens) + len(a.drafts)
            view = self.contexts.view(ctx)
            need = pages_to_reserve(view, new_tokens)
            if (
                state.suspended is not None
                or view.seq_len == 0
                or new_tokens > self.scheduler.limits.max_tokens
                or (need > 0 and not self.residency.try_now(state, need))
            ):
                task = asyncio.get_running_loop().create_task(
                    self._pass_slowly(state, a, tokens, slots, bind, answer, walk)
                )
                self._slow_passes.add(task)
                task.add_done_callback(self._slow_passes.discard)
                return None
            if need > 0:
                self.residency.grant(state, need)
                view = self.contexts.view(ctx)
            request = forward_request(
                a,
                bind,
                tokens=tokens,
                positions=a.positions,
                slots=slots,
                attention_masks=a.attention_masks,
                page_ids=list(view.page_ids),
                kv_len=view.seq_len,
            )
        except Exception as e:
            return self.fail(state, answer, e, walk)
        settled = functools.partial(self._settle_start, state, a, answer, walk, request, bind)
        self.scheduler.submit_then(request, settled)
        return None

    def _settle_start(
        self,
        state: EngineContext,
        a: PassRequest,
        answer: Answer,
        walk: list[int] | None,
        request: ForwardRequest,
        bind: PassBinding,
        out: RequestOutput | Exception,
    ) -> None:
        """Settle a pass ``start`` sent (or adopted from a step run ahead) the moment its batch ends."""
        try:
            if isinstance(out, Exception):
                raise out
            settle(self.contexts, state, request, out, a.held(), bind.salt)
            reply = self._reply(state, out, a.draft_budget)
        except Exception as e:
            self.fail(state, answer, e, walk)
        else:
            self._done(state, a, answer, reply, walk, request, bind)

    async def _pass_slowly(
        self,
        state: EngineContext,
        a: PassRequest,
        tokens: list[int],
        slots: list,
        bind: PassBinding,
        answer: Answer,
        walk: list[int] | None,
    ) -> None:
        """The general way through a pass: restore a suspended context, adopt cached prefix pages on a context's
        first pass, split a long prefill into chunks, wait in line for pages."""
        ctx, positions, attention_masks = a.ctx, a.positions, a.attention_masks
        try:
            if state.suspended is not None:
                await self.residency.restore(state, len(tokens) + len(a.drafts))
            if attention_masks is None and not a.drafts and self.contexts.seq_len(ctx) == 0:
                tokens, positions, slots = self._reuse_cached_prefix(state, tokens, positions, slots, bind.salt)
            start = 0
            for begin, end in prefill_chunks(len(tokens), self.scheduler.limits.max_tokens)[:-1]:
                if any(row < end for row, _ in slots):  # leading chunks carry no samplers
                    break
                leading = ForwardRequest(
                    token_ids=tokens[begin:end],
                    positions=positions[begin:end],
                    page_ids=[],  # set once reserved
                    kv_len=0,
                    attention_masks=attention_masks[begin:end] if attention_masks is not None else None,
                    adapter=bind.adapter,
                    zo_seed=bind.zo_seed,
                )
                await self.run(state, leading, 0, bind.salt)
                start = end
            if start:
                tokens, positions = tokens[start:], positions[start:]
                slots = [(row - start, s) for row, s in slots]
                attention_masks = attention_masks[start:] if attention_masks is not None else None
            request = forward_request(
                a,
                bind,
                tokens=tokens,
                positions=positions,
                slots=slots,
                attention_masks=attention_masks,
                page_ids=[],  # set once reserved
                kv_len=0,
            )
            out = await self.run(state, request, a.held(), bind.salt)
            reply = self._reply(state, out, a.draft_budget)
        except Exception as e:
            self.fail(state, answer, e, walk)
        else:
            self._done(state, a, answer, reply, walk, request, bind)

    def _done(
        self,
        state: EngineContext,
        a: PassRequest,
        answer: Answer,
        reply: PassReply,
        walk: list[int] | None,
        request: ForwardRequest,
        bind: PassBinding,
    ) -> None:
        """A pass ended well (``request``: the last it sent): answer it, or run a chained pass's next step on the
        token this one sampled."""
        if not a.chained:
            ahead = functools.partial(self.steps.run_ahead, state, a, request.slots) if a.run_ahead else None
            return self.end(state, answer, reply, ahead=ahead, known=a.known)
        sampled = state.sampled
        walk = reply.walk = walk if walk is not None else []
        if sampled is not None:
            walk.append(sampled)
        if a.steps > 1 and sampled is not None and sampled not in a.stop_ids:
            return self._chain(self.steps.chain(state, a, answer, request.slots, bind, walk))
        self.end(state, answer, reply, known=a.known)

    def _chain(self, run: ChainedSteps) -> None:
        """Send a chained pass's next step, or the rest of the pass the general way (``start``) when it needs to."""
        step = self.steps.next_step(run)
        if isinstance(step, PassRequest):
            return self.start(run.record, step, run.answer, run.walk)
        self.scheduler.submit_then(step, functools.partial(self._step_ended, run))
        return None

    def _step_ended(self, run: ChainedSteps, out: RequestOutput | Exception) -> None:
        """Settle a chained step the moment its batch ends: send the next one, or answer the pass."""
        try:
            reply = self.steps.step_ended(run, out)
            if reply is None:
                return self._chain(run)
        except Exception as e:
            return self.fail(run.record, run.answer, e, run.walk)
        self.end(run.record, run.answer, reply, known=run.a.known)
        return None

    def fail(self, state: EngineContext, answer: Answer, error: Exception, walk: list[int] | None) -> None:
        """A pass failed: a chained pass undoes the steps it ran before (``walk``: their tokens), so that nothing of
        it is in the KV, and the pass chained on it fails too."""
        if walk and self.records.get(state.id) is state:  # the context is still there
            truncate(self.contexts, self.residency, state, len(walk))
        self.end(state, answer, error=error)

    def end(
        self,
        state: EngineContext,
        answer: Answer,
        reply: PassReply | None = None,
        error: Exception | None = None,
        ahead: Callable[[], bool] | None = None,
        known: int = -1,
    ) -> None:
        """Answer the pass and hand the context's turn on (to its next request, when one waits), or keep it for
        the next step run ``ahead``. ``known`` >= 0: the answer carries the context's tokens from there on."""
        gate = state.gate
        try:
            if reply is not None:
                self.budgets.count(state.session, reply)
            if reply is not None and known >= 0:
                reply.tail, reply.tail_positions = self.residency.tail(state, known)
            answer(error, None if reply is None else encode(reply))
        finally:
            if ahead is None or gate.waiting() or self.budgets.spent(state.session) or not _started(ahead):
                gate.give()
            self.residency.wake()  # pages may have been freed

    # -- running and settling a request ----------------------------------------------------------------------------

    async def run(self, state: EngineContext, request: ForwardRequest, hold: int, salt: bytes) -> RequestOutput:
        """Run one request of a pass the general way: reserve the pages it needs (waiting in line, or restoring the
        context), point it at the context's pages, and settle it."""
        await self.residency.reserve(state, len(request.token_ids) + len(request.draft_tokens))
        view = self.contexts.view(state.id)
        request.page_ids, request.kv_len = list(view.page_ids), view.seq_len
        out = await self.scheduler.submit(request)
        return settle(self.contexts, state, request, out, hold, salt)

    # -- what a pass runs on, and its answer -----------------------------------------------------------------------

    def _input(self, state: EngineContext, a: PassRequest) -> list[int] | None:
        """The pass's input tokens, once it is the context's turn: a chained pass's is the token its predecessor
        sampled, and None when that is a stop token (nothing runs). Applies the pass's bid, and a suspension
        deferred until this pass began."""
        sampled, state.sampled = state.sampled, None
        a.check()
        tokens = a.tokens
        if a.chained and (tokens := self.steps.chained_input(a, sampled)) is None:
            return None
        if a.bid is not None:
            self.residency.set_bid(state, a.bid)
        self.residency.pass_begins(state)
        if len(tokens) != len(a.positions):
            raise ValueError(f"{len(a.positions)} positions for {len(tokens)} input tokens")
        return tokens

    def _binding(self, state: EngineContext, a: PassRequest) -> PassBinding:
        """What the pass runs under; a plain one (no adapter, zo seed or attention mask, unsalted context) shares
        ``PLAIN_PASS``."""
        adapter, zo_seed, masked = a.adapter, a.zo_seed, a.attention_masks is not None
        if adapter is None and zo_seed is None and not masked and not state.salt:
            return PLAIN_PASS
        adapter_salt = b"" if adapter is None else self.adapters.owned(state.session, adapter).salt
        if zo_seed is not None:
            if adapter is None:
                raise ValueError("zo_seed perturbs an adapter: pass the adapter too")
            if not isinstance(zo_seed, int) or not -(1 << 63) <= zo_seed < 1 << 63:
                raise ValueError(f"zo_seed must be a 64-bit integer, got {zo_seed!r}")
        if (masked or zo_seed is not None) and not state.salt:  # such KV must never be shared by prefix
            state.salt = uuid.uuid4().bytes
        return PassBinding(state.salt + adapter_salt, adapter, zo_seed)

    def _reuse_cached_prefix(
        self, state: EngineContext, tokens: list[int], positions: list[int], slots: list, salt: bytes
    ):
        """A fresh context whose first pages match cached ones (of its namespace: ``page_store.namespace_key``)
        adopts them instead of recomputing them (prefix caching). Rows that carry samplers or probes, and the last
        token, are always computed."""
        first_row = min((row for row, _ in slots), default=len(tokens))
        usable = min(first_row, len(tokens) - 1) // self.page_size * self.page_size
        if usable <= 0:
            return tokens, positions, slots
        reused = self.contexts.reuse_prefix(state.id, tokens[:usable], positions[:usable], salt)
        self.prefix_hit_tokens += reused
        self.prefix_hits[state.session.username] += reused
        return tokens[reused:], positions[reused:], [(row - reused, s) for row, s in slots]

    def _reply(self, state: EngineContext, out: RequestOutput, draft_budget: int) -> PassReply:
        """The pass's answer; remembers the token it sampled for a pass chained on it."""
        ctx = state.id
        seq_len = self.contexts.seq_len(ctx)
        sampled = out.tokens[-1] if out.tokens else next((s.token for s in out.slots if s.token is not None), None)
        next_drafts = []
        if sampled is not None:
            state.sampled = sampled
            if draft_budget > 0:
                text = lambda: self.contexts.tokens(ctx)  # noqa: E731 (read only when the index is rebuilt)
                next_drafts = ngram.draft(state, text, seq_len, sampled, draft_budget)
        return PassReply(
            slots=[output_to_wire(s) for s in out.slots], walk=out.tokens, seq_len=seq_len, next_drafts=next_drafts
        )


def _started(step_ahead: Callable[[], bool]) -> bool:
    try:
        return step_ahead()
    except Exception:  # a mere optimisation: never leave the gate held over it
        log.exception("could not run a step ahead")
        return False
