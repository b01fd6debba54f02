"""A replica that leaves hands its contexts and snapshots to another replica of the model, KV pages and all, so the
prefill they hold is not lost with it (``transfer.py`` reads and installs the pages).

The leaving side (``leave``): from the moment it starts, every request waits (``hold``); each context's operations
already under way end first (its gate is taken, ``GATES_S`` at most: one still busy then stays, and is recomputed
from its inferlet's lineage should this replica go). Then every context and snapshot goes to the target in one Ray
call, through the object store. Those it adopted end here; every request from then on, the waiting ones first, is
answered ``ReplicaMoved`` with a ``MovedNotice`` naming the target, where the inferlet's link claims its contexts
(``inferlet._failover``). If the target does not take the handover, nothing ended here and the waiting requests run
as if nothing happened.

The adopting side (``adopt``) verifies each context's session by its capability as any request's, installs its
pages, and keeps it for its inferlet's ``claim`` for ``CLAIM_S``; one never claimed (its inferlet went to another
replica, or ended) is released then, as is every context of an instance revoked meanwhile. A snapshot becomes this
replica's, and the directory names this replica its holder.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pie_workers.deadlines import answer as answer_of
from pie_workers.engine.channel import Answer
from pie_workers.engine.record import EngineContext, Session
from pie_workers.engine.transfer import (
    Adopted,
    Handover,
    HoldingState,
    MovedContext,
    MovedSnapshot,
    fill,
    layout_of,
    place,
    read_holding,
)
from pie_workers.wire.messages import Claim, MovedNotice, decode, encode
from pie_workers.wire.pages import pages_for

if TYPE_CHECKING:
    from pie_workers.engine.service import ReplicaEngine

log = logging.getLogger(__name__)

GATES_S = 30.0  # how long a leaving replica waits for the operations in flight on its contexts
HANDOVER_S = 120.0  # for the target to install everything
CLAIM_S = 120.0  # how long an adopted context waits for its inferlet (``inferlet._failover.FAILOVER_S``)


class ReplicaMoved(Exception):
    """This replica left: the inferlet's contexts are on the replica the notice names (travels as the notice)."""

    def __init__(self, notice: MovedNotice):
        super().__init__(f"replica {notice.source} left; its contexts moved to {', '.join(notice.addresses)}")
        self.wire = encode(notice)


class Handovers:
    """One engine's handovers: the one it makes when it leaves, and those it adopts."""

    def __init__(self, engine: ReplicaEngine, source: str):
        self.engine = engine
        self.source = source  # how this replica names itself to the target (its device name)
        self.notice: MovedNotice | None = None  # set once it left: every request is answered with it
        self.unnotified: set[str] = set()  # sessions whose contexts moved and that have not been told yet
        self.moved_out = self.moved_in = self.claimed = 0
        self._held: list[tuple[str, Callable[[], Awaitable | None], Answer]] | None = None
        self._claims: dict[tuple[str, int], EngineContext] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def leaving(self) -> bool:
        return self._held is not None or self.notice is not None

    def hold(self, session: Session, dispatch: Callable[[], Awaitable | None], answer: Answer) -> None:
        """A request while leaving: refused with the notice once this replica left, else run (``dispatch``) or
        refused once the handover is over."""
        if self.notice is not None:
            self.unnotified.discard(session.name)
            raise ReplicaMoved(self.notice)
        self._held.append((session.name, dispatch, answer))

    # -- leaving -------------------------------------------------------------------------------------------------

    async def leave(self, target, addresses: list[str]) -> Adopted:
        """Hand every context and snapshot to ``target`` (the rank-0 actor of another replica of the model, whose
        inferlets reach it at ``addresses``); returns what it adopted. Raises, having changed nothing, when the
        handover could not be made (this replica then serves on)."""
        if self.leaving:
            raise RuntimeError(f"replica {self.source} is already leaving")
        engine, self._held = self.engine, []
        taken: list[EngineContext] = []
        try:
            layout = layout_of(engine.runner)
            taken = await self._take_gates()
            await engine.scheduler.submit(None)  # copies queued into these pages (a fork's, a save's) have run
            table = engine.contexts
            handover = Handover(
                self.source, layout, table.page_size,
                [self._export(state) for state in taken],
                [MovedSnapshot(o, n, read_holding(table, h, engine.runner)) for o, n, h in table.snapshot_holdings()],
            )  # fmt: skip
            adopted = await answer_of(target.adopt.remote(handover), "the replica taking over", HANDOVER_S)
        except BaseException:
            for state in taken:
                state.gate.give()
            self._resume()
            raise
        self.notice = MovedNotice(self.source, list(addresses))
        self._drop(adopted, taken)
        held, self._held = self._held, None
        for name, _, answer in held:
            self.unnotified.discard(name)
            answer(ReplicaMoved(self.notice), None)
        log.info("replica %s handed %d contexts and %d snapshots to %s (%d refused)", self.source,
                 len(adopted.contexts), len(adopted.snapshots), addresses, len(adopted.refused))  # fmt: skip
        return adopted

    async def _take_gates(self) -> list[EngineContext]:
        """Every live context's gate, once the operations already waiting for it have run (``GATES_S`` at most)."""
        loop, records = asyncio.get_running_loop(), self.engine.records
        deadline, taken = loop.time() + GATES_S, []
        for state in list(records):
            if not state.gate.take_now():
                try:
                    await asyncio.wait_for(state.gate.take(), max(0.01, deadline - loop.time()))
                except TimeoutError:
                    log.warning("context %d stayed busy: it does not move with its KV", state.id)
                    continue
            if records.get(state.id) is not state:  # destroyed while it waited
                state.gate.give()
                continue
            self.engine.passes.steps.take_ahead(state)
            taken.append(state)
        return taken

    def _export(self, state: EngineContext) -> MovedContext:
        table = self.engine.contexts
        holding = table.holding(state.id)
        if (suspended := state.suspended) is None:
            kept = read_holding(table, holding, self.engine.runner)
        else:  # no pages here: its text goes, to be recomputed where it lands, as it would have been here
            text = suspended.text
            tokens, positions = [t for t, _ in text], [p for _, p in text]
            kept = HoldingState(tokens, positions, [b""] * len(text), suspended.committed, holding.namespace, None)
        return MovedContext(state.session.name, state.id, kept, state.salt, state.sampled, state.bid)

    def _drop(self, adopted: Adopted, taken: list[EngineContext]) -> None:
        """End here what the target adopted; let go of the gates."""
        engine, moved = self.engine, set(adopted.contexts)
        for state in taken:
            if (state.session.name, state.id) in moved:
                view = engine.contexts.view(state.id)
                engine.records.destroy(state)
                working = set(view.page_ids[len(view.page_ids) - view.working_pages :])
                engine.scheduler.withdraw(working, ReplicaMoved(self.notice))
                self.unnotified.add(state.session.name)
            state.gate.give()
        for owner, name in adopted.snapshots:
            engine.contexts.delete(owner, name)
        self.moved_out += len(adopted.contexts) + len(adopted.snapshots)
        engine.residency.wake()

    def _resume(self) -> None:
        """The handover failed: run what waited for it."""
        held, self._held = self._held or [], None
        for _, dispatch, answer in held:
            try:
                work = dispatch()
            except Exception as e:
                answer(e, None)
                continue
            if work is not None:
                task = asyncio.get_running_loop().create_task(_answered(work, answer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    # -- adopting ------------------------------------------------------------------------------------------------

    async def adopt(self, handover: Handover) -> Adopted:
        """Install what a leaving replica handed over (``leave``'s other end)."""
        engine = self.engine
        if not isinstance(handover, Handover):
            raise TypeError(f"malformed handover: a {type(handover).__name__}, not a Handover")
        handover.check(engine.store.page_size, layout_of(engine.runner))
        refused: list[str] = []
        placed = []
        for item in [*handover.contexts, *handover.snapshots]:
            what = f"context {item.ctx}" if isinstance(item, MovedContext) else f"snapshot {item.name!r}"
            try:
                placed.append((item, *self._place(item)))
            except Exception as e:  # its session is no longer valid, or memory is short: it stays at the source
                refused.append(f"{what}: {e}")
        await engine.scheduler.submit(None)  # moves queued for the pages just handed out have run
        contexts, snapshots = [], []
        for item, session, ctx, reused, pages in placed:
            if item.holding.kv is not None:
                fill(engine.contexts, ctx, item.holding, reused, pages, engine.runner)
            if isinstance(item, MovedContext):
                self._keep_for_claim(item, session, ctx, len(pages))
                contexts.append((item.session, item.ctx))
            elif await self._rehome(item, ctx):
                snapshots.append((item.owner, item.name))
            else:
                refused.append(f"snapshot {item.name!r}: the name is taken here")
        self.moved_in += len(contexts) + len(snapshots)
        if contexts:
            asyncio.get_running_loop().call_later(CLAIM_S, self._expire, contexts)
        return Adopted(contexts, snapshots, refused)

    def _place(self, item: MovedContext | MovedSnapshot) -> tuple[Session | None, int, int, list[int]]:
        engine, state = self.engine, item.holding
        session = engine.sessions.admit(item.session) if isinstance(item, MovedContext) else None
        owner, key = (session.username, session.key) if session is not None else (item.owner, None)
        need = 0 if state.kv is None else pages_for(len(state.tokens), engine.store.page_size)
        if not engine.residency.try_now(None, need):
            raise MemoryError(f"{need} pages are not free here")
        ctx = engine.contexts.create(owner, key, state.namespace)
        if state.kv is None:
            return session, ctx, 0, []
        try:
            return session, ctx, *place(engine.contexts, ctx, state)
        except BaseException:
            engine.contexts.destroy(ctx)
            raise

    def _keep_for_claim(self, item: MovedContext, session: Session, ctx: int, pages: int) -> None:
        engine = self.engine
        record = engine.records.add(ctx, session)
        if item.holding.kv is None and item.holding.tokens:  # it was suspended: recomputed on its next pass
            text = list(zip(item.holding.tokens, item.holding.positions, strict=True))
            engine.residency.add_suspended(record, text, item.holding.committed)
        engine.residency.charge(record, pages)
        engine.residency.set_bid(record, item.bid)
        record.salt, record.sampled = item.salt, item.sampled
        self._claims[item.session, item.ctx] = record

    async def _rehome(self, item: MovedSnapshot, ctx: int) -> bool:
        """Make the installed holding snapshot ``item`` here, held here in the directory too."""
        engine = self.engine
        try:
            engine.contexts.keep(ctx, item.name)
        except ValueError:
            engine.contexts.destroy(ctx)
            return False
        if engine.directory is not None:
            await engine.directory.rehome(item.owner, item.name)
            if engine.contexts.snapshot_text(item.owner, item.name) is not None:
                engine.contexts.mirrored(item.owner, item.name)
        return True

    def _expire(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            record = self._claims.pop(key, None)
            if record is not None and self.engine.records.get(record.id) is record:
                self.engine.records.destroy(record)
        self.engine.residency.wake()

    async def op_claim(self, session: Session, claims: list) -> list[dict | None]:
        """The contexts a leaving replica handed over for this session, by their ids there, each as ``fork``
        answers (None: not here; the inferlet recomputes it)."""
        if not isinstance(claims, list):
            raise ValueError(f"claim takes a list of Claim records, got {type(claims).__name__}")
        asked = [decode(Claim, claim) for claim in claims]
        for claim in asked:
            if not isinstance(claim.known, int) or claim.known < -1 or not isinstance(claim.ctx, int):
                raise ValueError(f"malformed Claim: {claim!r}")
        engine, out = self.engine, []
        for claim in asked:
            record = self._claims.pop((session.name, claim.ctx), None)
            if record is None or engine.records.get(record.id) is not record or record.session is not session:
                out.append(None)
                continue
            self.claimed += 1
            engine.residency.touch(record)
            recomputable = record.suspended is not None or engine.contexts.recomputable(record.id)
            out.append(engine._made(record, claim.known, recomputable))
        return out


async def _answered(work: Awaitable, answer: Answer) -> None:
    try:
        result = await work
    except Exception as e:
        answer(e, None)
    else:
        answer(None, result)
