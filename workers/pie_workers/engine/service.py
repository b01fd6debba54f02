"""The replica engine on rank 0: contexts and pages, the batch scheduler, and the channel inferlets talk to.

Every operation an inferlet can ask of a replica is named in ``ReplicaEngine``'s table of operations. Forwards go
through the scheduler; the engine itself reserves the pages a forward needs, records lineage for what the forward
wrote (inputs plus the drafts the model accepted — rejected drafts are rolled back here, so KV, ``seq_len`` and
lineage always agree), commits every full page to the prefix trie, and returns surplus pages. A context belongs to the
inferlet run (session) that made it; snapshots and LoRA adapters (``AdapterRegistry``) belong to the user.

KV written under a custom attention mask or a zo seed is salted per context, so the prefix trie never shares it;
KV written under an adapter is salted with the adapter's current weights, so only passes with the same adapter
share it.

When the pool runs short, ``Residency`` decides by bid who keeps pages; every operation on a suspended context first
restores it (copying its pages back from host memory, or recomputing them), so inferlets never see a suspension
except as a slower step. A plain step that asks for it has the next one run *ahead*, before the inferlet asks for it
(see ``PassArgs``). With a market actor, ``MarketLink`` reports the device to it every round and applies its
decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pie_workers.engine.adapter_registry import AdapterRegistry
from pie_workers.engine.channel import Answer, ChannelServer
from pie_workers.engine.contexts import ContextError, ContextTable, ContextView
from pie_workers.engine.gate import Gate
from pie_workers.engine.market_link import MarketLink
from pie_workers.engine.ngram import NgramDrafter
from pie_workers.engine.page_store import OutOfPages, PageStore
from pie_workers.engine.protocol import PassArgs, PassReply
from pie_workers.engine.residency import Residency, pages_to_reserve
from pie_workers.engine.scheduler import BatchLimits, BatchScheduler
from pie_workers.runner import ModelRunner
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, RequestOutput
from pie_workers.wire.codec import output_to_wire, slot_from_wire
from pie_workers.wire.pages import pages_for

log = logging.getLogger(__name__)


@dataclass
class Session:
    """One inferlet run's connection: who it is and which contexts it holds."""

    name: str  # ``user/instance/session``
    username: str
    instance: str
    key: str  # the inferlet run; scopes its contexts
    contexts: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class PassBinding:
    """What a forward runs under besides its tokens: the salt its KV is hashed with, the adapter and zo seed."""

    salt: bytes = b""
    adapter: int | None = None
    zo_seed: int | None = None


PLAIN_PASS = PassBinding()


@dataclass(slots=True, eq=False)
class _Ahead:
    """A step run before the inferlet asked for it: the next step of a plain pass, on the token that pass sampled,
    with the same samplers and probes. Its KV lies past the context's end, where nothing reads it, until a request
    that repeats it (``repeats``) adopts it; any other turn on the context drops it."""

    token: int
    position: int
    slots: list  # the pass's slots on the wire, as a request for this step carries them
    seq_len: int  # the context's length it ran at
    out: RequestOutput | Exception | None = None  # None while its batch runs

    def repeats(self, a: PassArgs) -> bool:
        return (
            a.plain()
            and a.tokens == [self.token]
            and a.positions == [self.position]
            and a.slots == self.slots
            and isinstance(self.out, RequestOutput)
            and self.out.error is None
        )


@dataclass(slots=True, eq=False)
class _Steps:
    """A chained pass past its first step: what each further step reuses, and the context as the last step left it
    (only this pass changes the context while it holds the context's gate)."""

    session: Session
    a: PassArgs
    gate: Gate
    answer: Answer
    slots: list
    bind: PassBinding
    walk: list[int]  # every step's token so far
    left: int  # steps still to run
    position: int  # the next step's input position
    token: int  # the next step's input
    page_ids: list[int]  # the context's pages, as the batch takes them
    seq_len: int


class ReplicaEngine:
    def __init__(self, runner: ModelRunner, limits: BatchLimits = BatchLimits(), market=None, device: str = "replica"):
        """``market``: the cluster's market actor (its handle), to report this device to; None runs without one
        (bids still rank contexts locally, nobody pays rent)."""
        self.runner = runner
        self.page_size = runner.page_size
        self.store = PageStore(runner.num_pages, runner.page_size)
        self.contexts = ContextTable(self.store)
        self.drafter = NgramDrafter()
        self.residency = Residency(
            self.contexts,
            busy=lambda ctx: ctx in self._gates and self._gates[ctx].locked(),
            clock=lambda: self.scheduler.batches_fired,
            host_pages=runner.kv.host_pages,
            offload=lambda pairs: self.scheduler.submit(None, offloads=pairs),
            copy_in=lambda pairs: self.scheduler.submit(None, restores=pairs),
            recompute=self._recompute,
            forget_drafts=self.drafter.forget,
            made=None if market is None else lambda process, pages: self.market.made(process, pages),
        )
        self.scheduler = BatchScheduler(self._execute, limits, contexts=lambda: len(self._gates))
        self.channel = ChannelServer(self._handle)
        self.market = (
            MarketLink(market, device, self.contexts, self.residency, self.scheduler) if market is not None else None
        )
        self._sessions: dict[str, Session] = {}  # by the session string ``user/instance/session``
        self._gates: dict[int, Gate] = {}  # each context's turn-taking
        self._slow_passes: set[asyncio.Task] = set()
        self._salts: dict[int, bytes] = {}
        self._sampled: dict[int, int] = {}  # the token a context's latest pass sampled, for a pass chained on it
        self.chained_passes = 0  # passes that ran on the token their predecessor sampled
        self._ahead: dict[int, _Ahead] = {}  # a context's step run ahead
        self.steps_ahead = 0  # steps run before they were asked for
        self.steps_ahead_taken = 0  # ... that a request then adopted
        self.adapters = AdapterRegistry(runner)
        # every operation but ``forward`` (see ``_handle``): name on the wire -> handler(session, *args)
        self._operations: dict[str, Callable[..., Awaitable]] = {
            "create": self.op_create,
            "destroy": self.op_destroy,
            "close": self.op_close,
            "fork": self.op_fork,
            "save": self.op_save,
            "snapshot": self.op_snapshot,
            "open": self.op_open,
            "take": self.op_take,
            "delete": self.op_delete,
            "truncate": self.op_truncate,
            "stats": self.op_stats,
            "account": self.op_account,
            "suspend": self.op_suspend,
            "set_bid": self.op_set_bid,
            "adapter_create": self.adapters.create,
            "adapter_open": self.adapters.open,
            "adapter_fork": self.adapters.fork,
            "adapter_save": self.adapters.save,
            "adapter_load": self.adapters.load,
            "adapter_destroy": self.adapters.destroy,
        }
        self._tasks: list[asyncio.Task] = []

    def start(self, host_ip: str) -> dict[str, str]:
        addresses = self.channel.bind(host_ip)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.scheduler.run()), loop.create_task(self.channel.serve())]
        if self.market is not None:
            self._tasks.append(loop.create_task(self.market.run()))
        return addresses

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.channel.close()

    async def _execute(self, batch: ForwardBatch) -> list[RequestOutput]:
        """Runs the forward on the event loop's thread: a thread hop per batch costs more than it saves (the GIL
        is contended either way), and inferlet messages simply queue in the socket until the batch is done. So
        first let what is already due run, and send the replies it produced: the inferlets then make their next
        requests while this batch runs, instead of after it."""
        await asyncio.sleep(0)
        self.channel.flush()
        return self.runner.execute(batch)

    # -- dispatch ----------------------------------------------------------------------------------------------

    def _handle(self, name: str, op: str, args: list, answer: Answer) -> Awaitable | None:
        """``name`` is the requesting session, ``user/instance/session``; it scopes every context operation.
        Returns the operation as a coroutine for the channel to run as a task, or None for a forward: the engine
        runs those without a task and calls ``answer`` itself."""
        session = self._sessions.get(name)
        if session is None:
            username, instance, key = name.split("/", 2)
            session = self._sessions[name] = Session(name, username, instance, key)
        if op == "forward":
            return self._forward(session, PassArgs.from_wire(args), answer)
        handler = self._operations.get(op)
        if handler is None:
            raise ValueError(f"unknown replica operation {op!r}")
        return self._operation(handler(session, *args))

    async def _operation(self, work: Awaitable):
        try:
            return await work
        finally:
            self.residency.wake()  # pages may have been freed

    def _own(self, session: Session, ctx: int) -> int:
        if ctx not in session.contexts:
            raise ContextError(f"context {ctx} does not exist or was released")
        self.residency.touch(ctx)
        return ctx

    @contextlib.asynccontextmanager
    async def _turn(self, session: Session, ctx: int):
        """Hold the context's gate for an operation other than a pass (which drops a step run ahead: it would no
        longer follow)."""
        async with self._gates[self._own(session, ctx)]:
            self._take_ahead(ctx)
            yield

    def _adopt(self, session: Session, ctx: int, new_pages: bool = False) -> int:
        """``new_pages``: its working pages were allocated for it (a fork's or an open's copies), not handed over
        (a taken snapshot's): they count as pages its process made."""
        session.contexts.add(ctx)
        self._gates[ctx] = Gate()
        self.residency.owners[ctx] = session.instance
        if new_pages:
            self.residency.charge(ctx, self.contexts.view(ctx).working_pages)
        return ctx

    async def _run_copies(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            await self.scheduler.submit(None, copies)

    # -- context lifetime --------------------------------------------------------------------------------------

    async def op_create(self, session: Session) -> int:
        return self._adopt(session, self.contexts.create(session.username, session.key))

    async def op_destroy(self, session: Session, ctx: int) -> None:
        view = self.contexts.view(self._own(session, ctx))
        self.contexts.destroy(ctx)
        session.contexts.discard(ctx)
        self._gates.pop(ctx, None)
        self._salts.pop(ctx, None)
        self._sampled.pop(ctx, None)
        self._ahead.pop(ctx, None)
        self.drafter.forget(ctx)
        self.residency.forget(ctx)
        working = view.page_ids[len(view.page_ids) - view.working_pages :]
        self.scheduler.withdraw(set(working), ContextError(f"context {ctx} was destroyed"))

    async def op_close(self, session: Session) -> int:
        """The inferlet ended: release every context it still holds (snapshots survive)."""
        n = 0
        for ctx in list(session.contexts):
            await self.op_destroy(session, ctx)
            n += 1
        self._sessions.pop(session.name, None)
        if self.market is not None:
            self.market.forget(session.instance)
            try:
                await self.market.round(settle_made=True)
            except Exception:  # the contexts are gone either way; the market only misses this round
                log.exception("market round at the end of %s failed", session.name)
        return n

    async def op_fork(self, session: Session, ctx: int) -> list[int]:
        """A child sharing the context's pages. When memory is short the child is born suspended (it holds no
        pages and is recomputed on its first pass), so a fork never waits."""
        async with self._turn(session, ctx):
            suspended = self.residency.suspended.get(ctx)
            if suspended is None and self.residency.try_now(ctx, self.contexts.view(ctx).working_pages):
                child, copies = self.contexts.fork(ctx)
            else:
                if suspended is None and not self.contexts.recomputable(ctx):
                    raise OutOfPages(self.contexts.view(ctx).working_pages, self.store.available, self.store.num_pages)
                text = (suspended.text, suspended.committed) if suspended else self.contexts.text(ctx)
                child, copies = self.contexts.create(session.username, session.key), []
                self.residency.add_suspended(child, *text)
        self._adopt(session, child, new_pages=True)
        if ctx in self._salts:
            self._salts[child] = self._salts[ctx]
        self.residency.inherit(child, ctx)
        await self._run_copies(copies)
        return [child, self.residency.seq_len(child)]

    async def op_save(self, session: Session, ctx: int, name: str) -> None:
        async with self._turn(session, ctx):
            await self.residency.restore_for_snapshot(ctx)
            copies = self.contexts.save(ctx, name)
        await self._run_copies(copies)

    async def op_snapshot(self, session: Session, ctx: int) -> str:
        async with self._turn(session, ctx):
            await self.residency.restore_for_snapshot(ctx)
            name, copies = self.contexts.snapshot(ctx)
        await self._run_copies(copies)
        return name

    async def op_open(self, session: Session, name: str) -> list[int] | None:
        """A copy of the snapshot; born suspended (recomputed on its first pass) when memory is short."""
        try:
            pages = self.contexts.view_snapshot(session.username, name).working_pages
        except ContextError:
            return None
        if self.residency.try_now(None, pages):
            ctx, copies = self.contexts.open(session.username, name, session.key)
        else:
            text = self.contexts.snapshot_text(session.username, name)
            if text is None:
                raise OutOfPages(pages, self.store.available, self.store.num_pages)
            ctx, copies = self.contexts.create(session.username, session.key), []
            self.residency.add_suspended(ctx, *text)
        self._adopt(session, ctx, new_pages=True)
        await self._run_copies(copies)
        return [ctx, self.residency.seq_len(ctx)]

    async def op_take(self, session: Session, name: str) -> list[int] | None:
        ctx = self.contexts.take(session.username, name, session.key)
        if ctx is None:
            return None
        self._adopt(session, ctx)
        return [ctx, self.contexts.view(ctx).seq_len]

    async def op_delete(self, session: Session, name: str) -> None:
        self.contexts.delete(session.username, name)

    async def op_truncate(self, session: Session, ctx: int, n: int) -> int:
        async with self._turn(session, ctx):
            self._truncate(ctx, n)
            return self.residency.seq_len(ctx)

    def _truncate(self, ctx: int, n: int) -> None:
        self.drafter.forget(ctx)
        self._sampled.pop(ctx, None)
        if ctx in self.residency.suspended:  # no need to recompute what is cut
            self.residency.truncate(ctx, n)
        else:
            self.contexts.truncate(ctx, n)
            self._trim(ctx)

    async def op_stats(self, session: Session) -> dict:
        s = self.store.stats()
        return {
            "free": s.free,
            "working": s.working,
            "committed": s.committed,
            "cached": s.cached,
            "total": s.total,
            "contexts": self.contexts.stats().contexts,
            "queued": self.scheduler.queued,
            "suspended": len(self.residency.suspended),
            "suspensions": self.residency.suspensions,
            "offloaded": self.residency.offloaded,
            "waiting": self.residency.waiting,
            "batches": self.scheduler.batches_fired,
            "requests": self.scheduler.requests_served,
            "chained": self.chained_passes,
            "ahead": self.steps_ahead,
            "ahead_taken": self.steps_ahead_taken,
            "market_rounds": self.market.rounds if self.market else 0,
            "price": self.market.price if self.market else 0.0,
        }

    # -- forward -----------------------------------------------------------------------------------------------

    def _forward(self, session: Session, a: PassArgs, answer: Answer) -> None:
        """Run a pass once it is the context's turn; its answer is [slot outputs, verified walk, seq_len, next
        drafts], or None for a chained pass that stopped."""
        gate = self._gates[self._own(session, a.ctx)]
        gate.when_free(functools.partial(self._start_pass, session, a, gate, answer))

    def _start_pass(
        self, session: Session, a: PassArgs, gate: Gate, answer: Answer, walk: list[int] | None = None
    ) -> None:
        """The context's turn has come (this holds its gate). The common pass, on a resident context and needing no
        prefix lookup, prefill chunking or wait for pages, goes straight into the next batch and settles the
        moment the batch ends: no task, no wake-ups, and the next step's request finds the gate free. Any other
        pass continues as a task (``_pass_slowly``)."""
        ctx = a.ctx
        try:
            tokens = self._pass_input(ctx, a)
            if tokens is None:
                return self._end_pass(gate, answer, None)
            bind = self._binding(session, ctx, a.attention_masks is not None, a.adapter, a.zo_seed)
            slots = [(int(row), slot_from_wire(s)) for row, s in a.slots]
            if (ran_ahead := self._take_ahead(ctx, a)) is not None:
                return self._settle_start(session, a, gate, answer, walk, tokens, slots, bind, ran_ahead)
            new_tokens = len(tokens) + len(a.drafts)
            view = self.contexts.view(ctx)
            need = pages_to_reserve(view, new_tokens)
            if (
                ctx in self.residency.suspended
                or view.seq_len == 0
                or new_tokens > self.scheduler.limits.max_tokens
                or (need > 0 and not self.residency.try_now(ctx, need))
            ):
                task = asyncio.get_running_loop().create_task(
                    self._pass_slowly(session, a, tokens, slots, bind, gate, answer, walk)
                )
                self._slow_passes.add(task)
                task.add_done_callback(self._slow_passes.discard)
                return None
            if need > 0:
                self.residency.grant(ctx, need)
                view = self.contexts.view(ctx)
            request = self._pass_request(
                view, tokens, a.positions, slots, a.attention_masks, a.logit_mask, a.drafts, a.draft_positions,
                a.draft_masks, bind,
            )  # fmt: skip
        except Exception as e:
            return self._fail_pass(ctx, gate, answer, e, walk)
        settle = functools.partial(self._settle_start, session, a, gate, answer, walk, tokens, slots, bind)
        self.scheduler.submit_then(request, settle)
        return None

    def _settle_start(
        self, session: Session, a: PassArgs, gate: Gate, answer: Answer, walk, tokens, slots, bind, out
    ) -> None:
        """Settle a pass ``_start_pass`` sent (or adopted from a step run ahead) the moment its batch ends."""
        try:
            if isinstance(out, Exception):
                raise out
            self._settle_pass(a.ctx, out, tokens, a.positions, a.drafts, a.draft_positions, a.held(), bind)
            reply = self._pass_reply(a.ctx, out, a.draft_budget)
        except Exception as e:
            self._fail_pass(a.ctx, gate, answer, e, walk)
        else:
            self._pass_done(session, a, gate, answer, reply, walk, slots, bind)

    async def _pass_slowly(
        self,
        session: Session,
        a: PassArgs,
        tokens: list[int],
        slots: list,
        bind: PassBinding,
        gate: Gate,
        answer: Answer,
        walk: list[int] | None,
    ) -> None:
        """The general way through a pass: restore a suspended context, adopt cached prefix pages on a context's
        first pass, split a long prefill into chunks, wait in line for pages."""
        ctx, positions, attention_masks = a.ctx, a.positions, a.attention_masks
        try:
            if ctx in self.residency.suspended:
                await self.residency.restore(ctx, len(tokens) + len(a.drafts))
            if attention_masks is None and not a.drafts and self.contexts.seq_len(ctx) == 0:
                tokens, positions, slots = self._reuse_cached_prefix(ctx, tokens, positions, slots, bind.salt)
            chunk = self.scheduler.limits.max_tokens
            start = 0
            while len(tokens) - start > chunk:  # chunked prefill: leading chunks carry no samplers
                if any(row < start + chunk for row, _ in slots):
                    break
                await self._forward_once(
                    ctx,
                    tokens[start : start + chunk],
                    positions[start : start + chunk],
                    [],
                    attention_masks[start : start + chunk] if attention_masks is not None else None,
                    None,
                    [],
                    [],
                    None,
                    0,
                    bind,
                )
                start += chunk
            if start:
                tokens, positions = tokens[start:], positions[start:]
                slots = [(row - start, s) for row, s in slots]
                attention_masks = attention_masks[start:] if attention_masks is not None else None
            out = await self._forward_once(
                ctx,
                tokens,
                positions,
                slots,
                attention_masks,
                a.logit_mask,
                a.drafts,
                a.draft_positions,
                a.draft_masks,
                a.held(),
                bind,
            )
            reply = self._pass_reply(ctx, out, a.draft_budget)
        except Exception as e:
            self._fail_pass(ctx, gate, answer, e, walk)
        else:
            self._pass_done(session, a, gate, answer, reply, walk, slots, bind)

    def _pass_done(
        self, session: Session, a: PassArgs, gate: Gate, answer: Answer, reply: PassReply, walk, slots, bind
    ) -> None:
        """A pass ended well: answer it, or run a chained pass's next step on the token this one sampled. ``walk``:
        the tokens of a chained pass's steps before this one."""
        if a.chained is None:
            ahead = functools.partial(self._step_ahead, a, slots) if a.ahead is not None else None
            return self._end_pass(gate, answer, reply, ahead=ahead)
        sampled = self._sampled.get(a.ctx)
        walk = reply.walk = walk if walk is not None else []
        if sampled is not None:
            walk.append(sampled)
        if a.steps > 1 and sampled is not None and sampled not in a.chained:
            view = self.contexts.view(a.ctx)
            left, position = a.steps - 1, a.positions[0] + 1
            run = _Steps(
                session, a, gate, answer, slots, bind, walk, left, position, sampled, list(view.page_ids), view.seq_len
            )
            return self._next_step(run)
        self._end_pass(gate, answer, reply)

    def _next_step(self, run: _Steps) -> None:
        """A chained pass's next step, on the token the step before sampled. The plain case (the context resident,
        no suspension due, its pages at hand) goes straight into the next batch with what the pass already knows;
        anything else goes the general way, ``_start_pass``, holding back the pages of the steps so far."""
        ctx = run.a.ctx
        need = pages_for(run.seq_len + 1, self.page_size) - len(run.page_ids)
        residency = self.residency
        if ctx in residency.deferred or ctx in residency.suspended or (need > 0 and not residency.try_now(ctx, need)):
            a = dataclasses.replace(run.a, positions=[run.position], steps=run.left, hold=run.a.hold + len(run.walk))
            return self._start_pass(run.session, a, run.gate, run.answer, run.walk)
        if need > 0:
            run.page_ids = run.page_ids + residency.grant(ctx, need)
        self._sampled.pop(ctx, None)  # this step consumes it
        residency.touch(ctx)
        self.chained_passes += 1
        request = ForwardRequest(
            [run.token], [run.position], run.page_ids, run.seq_len, run.slots, None, run.a.logit_mask,
            adapter=run.bind.adapter, zo_seed=run.bind.zo_seed,
        )  # fmt: skip
        self.scheduler.submit_then(request, functools.partial(self._step_ended, run))

    def _step_ended(self, run: _Steps, out: RequestOutput | Exception) -> None:
        """Settle a step ``_next_step`` sent: record its token, and run the next step or end the pass (committing
        its full pages, as ``_settle_pass`` would, only then: a failed step undoes the steps before it)."""
        ctx = run.a.ctx
        try:
            if isinstance(out, Exception):
                raise out
            if out.error is not None:
                raise ValueError(out.error)
            self.contexts.record(ctx, [run.token], [run.position], run.bind.salt)
            self.drafter.observe(ctx, [run.token])
            run.seq_len += 1
            sampled = next((s.token for s in out.slots if s.token is not None), None)
            run.left -= 1
            run.position += 1
            if sampled is not None:
                self._sampled[ctx] = run.token = sampled
                run.walk.append(sampled)
                if run.left and sampled not in run.a.chained:
                    self.residency.wake()  # a waiter may find room now (as between single passes)
                    return self._next_step(run)
            self._commit_full(ctx, run.a.hold)
        except Exception as e:
            return self._fail_pass(ctx, run.gate, run.answer, e, run.walk)
        slots = [output_to_wire(s) for s in out.slots]
        self._end_pass(run.gate, run.answer, PassReply(slots=slots, walk=run.walk, seq_len=run.seq_len, next_drafts=[]))

    def _fail_pass(self, ctx: int, gate: Gate, answer: Answer, error: Exception, walk: list[int] | None) -> None:
        """A pass failed: a chained pass undoes the steps it ran before (``walk``: their tokens), so that nothing of
        it is in the KV, and the pass chained on it fails too."""
        if walk and ctx in self._gates:  # the context is still there
            self._truncate(ctx, len(walk))
        self._end_pass(gate, answer, error=error)

    def _end_pass(
        self,
        gate: Gate,
        answer: Answer,
        reply: PassReply | None = None,
        error: Exception | None = None,
        ahead: Callable | None = None,
    ) -> None:
        """Answer the pass and hand the context's turn on (to its next request, when one waits), or keep it for
        the next step run ``ahead``."""
        try:
            answer(error, None if reply is None else reply.to_wire())
        finally:
            if ahead is None or gate.waiting() or not self._started(ahead, gate):
                gate.give()
            self.residency.wake()  # pages may have been freed

    @staticmethod
    def _started(step_ahead: Callable[[Gate], bool], gate: Gate) -> bool:
        try:
            return step_ahead(gate)
        except Exception:  # a mere optimisation: never leave the gate held over it
            log.exception("could not run a step ahead")
            return False

    def _step_ahead(self, a: PassArgs, slots: list, gate: Gate) -> bool:
        """Run the next step of a plain pass that asked for it (see ``PassArgs``), holding the context's gate until
        its batch ends; False (nothing runs) when the pass is not plain, sampled a stop id, or the step would wait
        for a page."""
        ctx = a.ctx
        sampled = self._sampled.get(ctx)
        last = len(a.tokens) - 1
        if (
            not a.plain()
            or sampled is None
            or sampled in a.ahead
            or any(row != last for row, _ in a.slots)
            or ctx in self.residency.deferred
            or ctx in self.residency.suspended
        ):
            return False
        view = self.contexts.view(ctx)
        if need := pages_to_reserve(view, 1):
            if not self.residency.try_now(ctx, need):
                return False
            self.residency.grant(ctx, need)
            view = self.contexts.view(ctx)
        position = a.positions[-1] + 1
        ahead = self._ahead[ctx] = _Ahead(sampled, position, [[0, s] for _, s in a.slots], view.seq_len)
        self.steps_ahead += 1
        request = ForwardRequest(
            [sampled], [position], list(view.page_ids), view.seq_len, [(0, s) for _, s in slots], None, None
        )
        self.scheduler.submit_then(request, functools.partial(self._ahead_ended, ahead, gate))
        return True

    def _ahead_ended(self, ahead: _Ahead, gate: Gate, out: RequestOutput | Exception) -> None:
        ahead.out = out
        gate.give()  # to the request for this step, when it came meanwhile
        self.residency.wake()

    def _take_ahead(self, ctx: int, a: PassArgs | None = None) -> RequestOutput | None:
        """Take the context's step run ahead off it: its output if pass ``a`` repeats it and it still fits the
        context (a suspension since changes that), else None, giving back a page only it used."""
        ahead = self._ahead.pop(ctx, None)
        if ahead is None or ctx in self.residency.suspended:
            return None
        if a is not None and ahead.repeats(a) and self.contexts.seq_len(ctx) == ahead.seq_len:
            self.steps_ahead_taken += 1
            return ahead.out
        self._trim(ctx)
        return None

    def _pass_input(self, ctx: int, a: PassArgs) -> list[int] | None:
        """The pass's input tokens, once it is the context's turn: a chained pass's is the token its predecessor
        sampled, and None when that is a stop token (nothing runs). Applies the pass's bid, and a suspension
        deferred until this pass began."""
        sampled = self._sampled.pop(ctx, None)
        a.check()
        tokens = a.tokens
        if a.chained is not None:
            if sampled is None:
                raise ValueError(
                    f"context {ctx}: a chained pass follows the previous one, which failed or sampled no token"
                )
            if sampled in a.chained:
                return None
            tokens = [sampled]
            self.chained_passes += 1
        if a.bid is not None:
            self.residency.set_bid(ctx, a.bid)
        self.residency.pass_begins(ctx)
        if len(tokens) != len(a.positions):
            raise ValueError(f"{len(a.positions)} positions for {len(tokens)} input tokens")
        return tokens

    def _pass_reply(self, ctx: int, out: RequestOutput, draft_budget: int) -> PassReply:
        """The pass's answer; remembers the token it sampled for a pass chained on it."""
        seq_len = self.contexts.seq_len(ctx)
        sampled = out.tokens[-1] if out.tokens else next((s.token for s in out.slots if s.token is not None), None)
        next_drafts = []
        if sampled is not None:
            self._sampled[ctx] = sampled
            if draft_budget > 0:
                text = lambda: self.contexts.tokens(ctx)  # noqa: E731 (read only when the index is rebuilt)
                next_drafts = self.drafter.draft(ctx, text, seq_len, sampled, draft_budget)
        return PassReply(
            slots=[output_to_wire(s) for s in out.slots], walk=out.tokens, seq_len=seq_len, next_drafts=next_drafts
        )

    def _binding(
        self, session: Session, ctx: int, masked: bool, adapter: int | None, zo_seed: int | None
    ) -> PassBinding:
        """What the pass runs under; a plain one (no adapter, zo seed or attention mask, unsalted context) shares
        ``PLAIN_PASS``."""
        if adapter is None and zo_seed is None and not masked and ctx not in self._salts:
            return PLAIN_PASS
        adapter_salt = b"" if adapter is None else self.adapters.owned(session, adapter).salt
        if zo_seed is not None:
            if adapter is None:
                raise ValueError("zo_seed perturbs an adapter: pass the adapter too")
            if not isinstance(zo_seed, int) or not -(1 << 63) <= zo_seed < 1 << 63:
                raise ValueError(f"zo_seed must be a 64-bit integer, got {zo_seed!r}")
        if masked or zo_seed is not None:  # such KV must never be shared by prefix
            self._salts.setdefault(ctx, uuid.uuid4().bytes)
        return PassBinding(self._salts.get(ctx, b"") + adapter_salt, adapter, zo_seed)

    def _reuse_cached_prefix(self, ctx, tokens, positions, decoded, salt: bytes):
        """A fresh context whose first pages match cached ones adopts them instead of recomputing them (prefix
        caching). Rows that carry samplers or probes, and the last token, are always computed."""
        first_row = min((row for row, _ in decoded), default=len(tokens))
        usable = min(first_row, len(tokens) - 1) // self.page_size * self.page_size
        if usable <= 0:
            return tokens, positions, decoded
        reused = self.contexts.reuse_prefix(ctx, tokens[:usable], positions[:usable], salt)
        return tokens[reused:], positions[reused:], [(row - reused, s) for row, s in decoded]

    async def _forward_once(
        self,
        ctx,
        tokens,
        positions,
        slots,
        masks,
        logit_mask,
        drafts,
        draft_positions,
        draft_masks,
        hold,
        bind: PassBinding,
        trim: bool = True,
    ) -> RequestOutput:
        await self.residency.reserve(ctx, len(tokens) + len(drafts))
        view = self.contexts.view(ctx)
        request = self._pass_request(
            view, tokens, positions, slots, masks, logit_mask, drafts, draft_positions, draft_masks, bind
        )
        out = await self.scheduler.submit(request)
        return self._settle_pass(ctx, out, tokens, positions, drafts, draft_positions, hold, bind, trim)

    @staticmethod
    def _pass_request(
        view: ContextView, tokens, positions, slots, masks, logit_mask, drafts, draft_positions, draft_masks, bind
    ) -> ForwardRequest:
        """The pass as the batch takes it, over the context's pages (``view``: with those it needs reserved)."""
        return ForwardRequest(
            token_ids=tokens,
            positions=positions,
            page_ids=list(view.page_ids),
            kv_len=view.seq_len,
            slots=slots,
            attention_masks=masks,
            logit_mask=logit_mask,
            draft_tokens=drafts,
            draft_positions=draft_positions,
            draft_masks=draft_masks,
            adapter=bind.adapter,
            zo_seed=bind.zo_seed,
        )

    def _settle_pass(
        self, ctx, out: RequestOutput, tokens, positions, drafts, draft_positions, hold, bind, trim: bool = True
    ) -> RequestOutput:
        """Record what the pass wrote (inputs and accepted drafts), give back pages it left empty, and commit full
        pages except those touching the last ``hold`` tokens; a failed pass raises its error."""
        if out.error is None:
            accepted = len(out.tokens) - 1 if drafts else 0
            written = tokens + drafts[:accepted] if accepted else tokens
            self.contexts.record(
                ctx, written, positions + draft_positions[:accepted] if accepted else positions, bind.salt
            )
            self.drafter.observe(ctx, written)
        view = self.contexts.view(ctx)
        if trim or out.error is not None:
            self._trim(ctx, view)  # committing full pages below leaves the count of empty ones as it is
        if out.error is not None:
            raise ValueError(out.error)
        self._commit_full(ctx, hold, view)
        return out

    def _commit_full(self, ctx: int, hold: int, view: ContextView | None = None) -> None:
        """Commit the context's full working pages but those touching its last ``hold`` tokens."""
        view = view or self.contexts.view(ctx)
        if full := max(0, view.working_tokens - hold) // self.page_size:
            self.contexts.commit(ctx, full)

    # -- residency and the market -------------------------------------------------------------------------------

    async def op_account(self, session: Session) -> dict | None:
        """What ``inferlet.scheduling`` reads for the inferlet's process on this replica: its balance, endowment,
        and the dividend received and rent paid in the latest rounds, this device's clearing price and batch
        latency, the cost of a page. None when the replica runs without a market, or the process never joined it."""
        if self.market is None:
            return None
        account = await self.market.account(session.instance)
        if account is None:
            return None
        return {
            "balance": account["balance"],
            "endowment": account["endowment"],
            "dividend": account["dividend"],
            "paid": account["rent"],
            "page_cost": account["page_cost"],
            "price": self.market.price,
            "latency": self.market.latency_s or self.scheduler.last_latency_s,
        }

    async def op_suspend(self, session: Session, ctx: int) -> None:
        """Give the context's pages up now (kept in host memory when there is room); its next operation restores
        it. A no-op for a context that is already suspended."""
        async with self._turn(session, ctx):
            if ctx in self.residency.suspended:
                return
            if not self.contexts.recomputable(ctx):
                raise ContextError(
                    f"context {ctx} holds KV written under a custom attention mask, an adapter or a zo seed, which "
                    "could not be restored: it cannot be suspended"
                )
            self.residency.suspend(ctx)

    async def op_set_bid(self, session: Session, ctx: int, bid: float) -> None:
        """Credits per page per tick this context offers to keep its pages when memory is short."""
        self.residency.set_bid(self._own(session, ctx), bid)

    async def _recompute(self, ctx: int, tokens: list[int], positions: list[int], hold: int) -> None:
        """Rebuild a restored context's KV for these tokens, in chunks a batch takes, its pages already reserved;
        pages touching the last ``hold`` tokens stay uncommitted, as they were."""
        chunk = self.scheduler.limits.max_tokens
        for start in range(0, len(tokens), chunk):
            end = start + chunk
            await self._forward_once(
                ctx, tokens[start:end], positions[start:end], [], None, None, [], [], None, hold, PLAIN_PASS, trim=False
            )

    def _trim(self, ctx: int, view: ContextView | None = None) -> None:
        """Give back working pages that hold no tokens (after a rejected draft, a failed pass, or a truncate).
        ``view``: the context as it is now, when the caller has it."""
        view = view or self.contexts.view(ctx)
        spare = view.working_pages - pages_for(view.working_tokens, self.page_size)
        if spare > 0:
            self.contexts.release_working(ctx, spare)
