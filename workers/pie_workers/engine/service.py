"""The replica engine on rank 0: contexts and pages, the batch scheduler, and the channel inferlets talk to.

Every operation an inferlet can ask of a replica is named in ``ReplicaEngine``'s table of operations; its arguments
are the handler's parameters after the session, in order, and a structured answer is one of
``wire.messages``' replies. A forward is the exception: its one argument is a ``PassRequest``, and it goes through
``Passes`` (``passes.py``, with chained steps and steps run ahead in ``steps.py``), which answers it itself. Who
sends a request is its session's capability, verified once (``record.Sessions``). A context belongs
to the inferlet run (session) that made it; snapshots and LoRA adapters (``adapter_registry.py``) belong to the user.
What the engine keeps per context is one ``EngineContext`` record (``record.py``), made and ended by its registry.

When the pool runs short, ``Residency`` decides by bid who keeps pages; every operation on a suspended context first
restores it (copying its pages back from host memory, or recomputing them), so inferlets never see a suspension
except as a slower step. With a market actor, ``MarketLink`` reports the device to it every round and applies its
decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable

from pie_workers.engine.adapter_registry import AdapterRegistry
from pie_workers.engine.channel import Answer, ChannelServer
from pie_workers.engine.contexts import ContextError, ContextTable
from pie_workers.engine.directory_link import DirectoryLink
from pie_workers.engine.engine_stats import EngineStats, read_stats
from pie_workers.engine.handover import Handovers
from pie_workers.engine.holding import lineage_text
from pie_workers.engine.market_link import MarketLink
from pie_workers.engine.page_store import OutOfPages, PageStore
from pie_workers.engine.passes import Passes
from pie_workers.engine.record import EngineContext, EngineContexts, Session, Sessions
from pie_workers.engine.residency import Residency
from pie_workers.engine.scheduler import BatchLimits, BatchScheduler
from pie_workers.engine.settle import truncate
from pie_workers.engine.snapshot_ops import SnapshotOperations
from pie_workers.engine.tenancy import TenantLimits
from pie_workers.runner import GroupBroken, ModelRunner
from pie_workers.wire.admission import Revocation
from pie_workers.wire.batch import ForwardBatch, RequestOutput
from pie_workers.wire.messages import AccountReply, ContextReply, PassRequest, decode, encode

log = logging.getLogger(__name__)


class ReplicaEngine(SnapshotOperations):
    def __init__(
        self,
        runner: ModelRunner,
        limits: BatchLimits = BatchLimits(),
        market=None,
        device: str = "replica",
        directory: DirectoryLink | None = None,
        *,
        secret: bytes,
        tenants: TenantLimits = TenantLimits(),
    ):
        """``market``: the cluster's market actor (its handle), to report this device to; None runs without one
        (bids still rank contexts locally, nobody pays rent). ``directory``: the cluster's snapshot names (None:
        this replica's snapshots are its own). ``secret``: the cluster's, that every request's capability must be
        signed with (there is no unauthenticated mode). ``tenants``: what it bounds per verified user."""
        if not secret:
            raise ValueError("a replica engine needs the cluster's secret to verify its clients' capabilities")
        self.directory = directory
        self.tenants = tenants
        self.runner = runner
        self.store = PageStore(runner.num_pages, runner.page_size)
        self.contexts = ContextTable(self.store)
        self.records = EngineContexts(self.contexts, runner.kv.host_pages, tenants.shared_prefixes)  # live contexts
        self.sessions = Sessions(secret, directory.model if directory is not None else None)
        self.scheduler = BatchScheduler(self._execute, limits, contexts=self.records.__len__)
        self.residency = Residency(self.records, self.scheduler, count_made=market is not None)
        self.channel = ChannelServer(self._handle, self.sessions, self._disconnected, tenants.connections)
        self.market = (
            MarketLink(market, device, self.records, self.residency, self.scheduler) if market is not None else None
        )
        self.adapters = AdapterRegistry(runner, directory, tenants)
        self.passes = Passes(self.records, self.scheduler, self.residency, self.adapters)
        self.handovers = Handovers(self, device)  # its contexts' KV to another replica when it leaves, and back
        # every operation but ``forward`` (see ``_handle``): name on the wire -> handler(session, *args)
        self._operations: dict[str, Callable[..., Awaitable]] = {
            "create": self.op_create,
            "destroy": self.op_destroy,
            "close": self.op_close,
            "fork": self.op_fork,
            "restore": self.op_restore,
            "save": self.op_save,
            "snapshot": self.op_snapshot,
            "keep": self.op_keep,
            "open": self.op_open,
            "take": self.op_take,
            "delete": self.op_delete,
            "truncate": self.op_truncate,
            "stats": self.op_stats,
            "account": self.op_account,
            "suspend": self.op_suspend,
            "set_bid": self.op_set_bid,
            "claim": self.handovers.op_claim,
            "adapter_create": self.adapters.create,
            "adapter_open": self.adapters.open,
            "adapter_fork": self.adapters.fork,
            "adapter_save": self.adapters.save,
            "adapter_load": self.adapters.load,
            "adapter_destroy": self.adapters.destroy,
        }
        self._tasks: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()  # sessions being closed for a connection that dropped

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
        try:
            return self.runner.execute(batch)
        except GroupBroken:
            # fail-stop: dying leaves the batch's calls unanswered, so every inferlet's link moves to another
            # replica and sends them again, and the controller replaces the whole group at once
            log.critical("this replica's tensor-parallel group is broken: the leader exits", exc_info=True)
            os._exit(70)

    # -- dispatch ------------------------------------------------------------------------------------------------

    def _handle(self, name: str, op: str, args: list, answer: Answer) -> Awaitable | None:
        """``name`` is the requesting session, ``capability/session``; it scopes every context operation.
        Returns the operation as a coroutine for the channel to run as a task, or None for a forward: the engine
        runs those without a task and calls ``answer`` itself, once the context's turn has come."""
        session = self.sessions.admit(name)
        if self.handovers.leaving:  # refused with where its contexts went, once they are there
            return self.handovers.hold(session, functools.partial(self._dispatch, session, op, args, answer), answer)
        return self._dispatch(session, op, args, answer)

    def _dispatch(self, session: Session, op: str, args: list, answer: Answer) -> Awaitable | None:
        if op == "forward":
            if len(args) != 1:
                raise TypeError(f"a forward takes one PassRequest, got {len(args)} arguments")
            a = decode(PassRequest, args[0])
            state = self._own(session, a.ctx)
            state.gate.when_free(functools.partial(self.passes.start, state, a, answer))
            return None
        handler = self._operations.get(op)
        if handler is None:
            raise ValueError(f"unknown replica operation {op!r}")
        return self._operation(handler(session, *args), session)

    def _disconnected(self, names: set[str]) -> None:
        """An inferlet process went away without closing these sessions (it died with its host, or its
        connection broke): release what they hold, as closing them would."""
        for name in names:
            session = self.sessions.get(name)
            if session is not None:
                self._close_for(session)

    def revoke(self, revocation: Revocation) -> None:
        """A minter says which of its instances ended: their capabilities are refused from now on, their sessions
        still open here are closed as if their connections had dropped, and a connection that carried only them is
        closed."""
        instances, sessions = self.sessions.revoke(revocation)
        for session in sessions:
            self._close_for(session)
        self.channel.revoke(instances)

    def _close_for(self, session: Session) -> None:
        task = asyncio.get_running_loop().create_task(self._operation(self.op_close(session)))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _operation(self, work: Awaitable, session: Session | None = None):
        """Run an operation; one that made a context for a session closed meanwhile (a frame of ``close`` then
        ``create``) has it released at once, as the close would have."""
        try:
            return await work
        finally:
            if session is not None and session.closed:
                await self._release(session)
            self.residency.wake()  # pages may have been freed

    def _own(self, session: Session, ctx: int) -> EngineContext:
        state = self.records.get(ctx)
        if state is None or state.session is not session:
            raise ContextError(f"context {ctx} does not exist or was released")
        self.residency.touch(state)
        return state

    @contextlib.asynccontextmanager
    async def _turn(self, session: Session, ctx: int) -> AsyncIterator[EngineContext]:
        """Hold the context's gate for an operation other than a pass (which drops a step run ahead: it would no
        longer follow)."""
        state = self._own(session, ctx)
        async with state.gate:
            self.passes.steps.take_ahead(state)
            yield state

    def _adopt(self, session: Session, ctx: int, new_pages: bool = False) -> EngineContext:
        """``new_pages``: its working pages were allocated for it (a fork's or an open's copies), not handed over
        (a taken snapshot's): they count as pages its process made."""
        state = self.records.add(ctx, session)
        if new_pages:
            self.residency.charge(state, self.contexts.view(ctx).working_pages)
        return state

    async def _run_copies(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            await self.scheduler.submit(None, copies)

    # -- context lifetime ----------------------------------------------------------------------------------------

    async def op_create(self, session: Session, cache_salt: str = "") -> int:
        """A new empty context; it finds cached pages of its own user (any user's where the operator shares them)
        written by contexts created with the same ``cache_salt``."""
        return self.records.create(session, cache_salt).id

    async def op_destroy(self, session: Session, ctx: int) -> None:
        state = self._own(session, ctx)
        view = self.contexts.view(ctx)
        self.records.destroy(state)  # a pass still waiting for the gate finds nothing to follow
        working = view.page_ids[len(view.page_ids) - view.working_pages :]
        self.scheduler.withdraw(set(working), ContextError(f"context {ctx} was destroyed"))

    async def op_close(self, session: Session) -> int:
        """The inferlet ended: release every context it still holds (snapshots survive)."""
        session.closed = True
        held = await self._release(session)
        self.sessions.forget(session.name)
        self.channel.forget(session.name)
        if self.market is not None:
            self.market.forget(session.instance)
            try:
                await self.market.settle_ending()
            except Exception:  # the contexts are gone either way; the market only misses this round
                log.exception("market round at the end of %s failed", session.name)
        return held

    async def _release(self, session: Session) -> int:
        """Destroy every context ``session`` holds; how many there were."""
        held = [state.id for state in self.records if state.session is session]
        for ctx in held:
            await self.op_destroy(session, ctx)
        return len(held)

    async def op_fork(self, session: Session, ctx: int, known: int = -1) -> dict:
        """A child sharing the context's pages. When memory is short the child is born suspended (it holds no
        pages and is recomputed on its first pass), so a fork never waits. ``known``: see ``_made``."""
        async with self._turn(session, ctx) as parent:
            suspended, text = parent.suspended, None
            if suspended is None and self.residency.try_now(parent, self.contexts.view(ctx).working_pages):
                child, copies = self.contexts.fork(ctx)
            else:
                if suspended is None and not self.contexts.recomputable(ctx):
                    raise OutOfPages(self.contexts.view(ctx).working_pages, self.store.available, self.store.num_pages)
                text = (suspended.text, suspended.committed) if suspended else self.contexts.text(ctx)
                child, copies = self.contexts.create(session.username, session.key, self.contexts.namespace_of(ctx)), []
            child_state = self._adopt(session, child, new_pages=True)
            if text is not None:
                self.residency.add_suspended(child_state, *text)
        child_state.salt = parent.salt  # what it shares was written under the parent's salt
        child_state.bid = parent.bid
        await self._run_copies(copies)
        return self._made(child_state, known)

    async def op_restore(
        self,
        session: Session,
        tokens: list,
        positions: list,
        sampled: int | None = None,
        bid: float = 0.0,
        cache_salt: str = "",
    ) -> dict:
        """A context rebuilt from the lineage its inferlet mirrored, after the replica that held it died: born
        suspended and recomputed on its first pass. ``sampled``: the token its last pass sampled, which a pass
        chained on that one takes as input; ``bid``: the bid it made there; ``cache_salt``: the one it was created
        with (its recomputed pages land where its old ones were keyed)."""
        text = lineage_text(tokens, positions, self.runner.cfg.vocab_size)
        if sampled is not None and not (type(sampled) is int and 0 <= sampled < self.runner.cfg.vocab_size):
            raise ValueError(f"restore: sampled must be a token id or None, got {sampled!r}")
        state = self.records.create(session, cache_salt)
        if text:
            self.residency.add_suspended(state, text, 0)
        state.sampled = sampled
        await self.op_set_bid(session, state.id, bid)
        return encode(ContextReply(state.id, len(text)))

    def _made(self, state: EngineContext, known: int, recomputable: bool = True) -> dict:
        """The answer for a context just made; ``known`` >= 0 (an inferlet that mirrors lineage, which has this
        many of its tokens already): with its tokens from there on, or word that no mirror could rebuild it."""
        reply = ContextReply(state.id, self.residency.seq_len(state))
        if not isinstance(known, int) or known < -1:
            raise ValueError(f"known must be a token count >= 0, or -1 for none, got {known!r}")
        if known >= 0 and recomputable:
            reply.tail, reply.tail_positions = self.residency.tail(state, known)
        reply.recomputable = recomputable
        return encode(reply)

    async def op_truncate(self, session: Session, ctx: int, n: int) -> int:
        async with self._turn(session, ctx) as state:
            truncate(self.contexts, self.residency, state, n)
            return self.residency.seq_len(state)

    # -- residency and the market --------------------------------------------------------------------------------

    async def op_suspend(self, session: Session, ctx: int) -> None:
        """Give the context's pages up now (kept in host memory when there is room); its next operation restores
        it. A no-op for a context that is already suspended."""
        async with self._turn(session, ctx) as state:
            if state.suspended is not None:
                return
            if not self.contexts.recomputable(ctx):
                raise ContextError(
                    f"context {ctx} holds KV written under a custom attention mask, an adapter or a zo seed, which "
                    "could not be restored: it cannot be suspended"
                )
            self.residency.suspend(state)

    async def op_set_bid(self, session: Session, ctx: int, bid: float) -> None:
        """Credits per page per tick this context offers to keep its pages when memory is short."""
        self.residency.set_bid(self._own(session, ctx), bid)

    async def op_account(self, session: Session) -> dict | None:
        """What ``inferlet.scheduling`` reads for the inferlet's process on this replica: its balance, endowment,
        and the dividend received and rent paid in the latest rounds, this device's clearing price and batch
        latency, the cost of a page. None when the replica runs without a market, or the process never joined it."""
        if self.market is None:
            return None
        account = await self.market.account(session.instance)
        if account is None:
            return None
        reply = AccountReply(
            balance=account["balance"],
            endowment=account["endowment"],
            dividend=account["dividend"],
            paid=account["rent"],
            page_cost=account["page_cost"],
            price=self.market.price,
            latency=self.market.latency_s or self.scheduler.last_latency_s,
        )
        return encode(reply)

    # -- stats ---------------------------------------------------------------------------------------------------

    async def op_stats(self, session: Session) -> dict:
        """What ``stats`` tells a session over the wire: its own user's contexts, snapshots and prefix hits here, so
        no counter tells one user anything of another's work (the trusted side reads ``stats``)."""
        user = session.username
        own = [state for state in self.records if state.session.username == user]
        return {
            "contexts": len(own),
            "snapshots": len(self.contexts.snapshots_of(user)),
            "suspended": sum(state.suspended is not None for state in own),
            "prefix_hit_tokens": self.passes.prefix_hits[user],
        }

    async def stats(self) -> EngineStats:
        """The replica's numbers for the trusted side (``pie status``, benchmarks); a coroutine, so that a caller
        on another thread reads them on the engine's loop."""
        return read_stats(self)
