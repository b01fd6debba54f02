"""The engine's snapshot operations: save (or keep, moving the pages), open, take and delete a snapshot, named
per user across the cluster through the user directory when the replica has one (``directory_link.py``).

A mixin of ``ReplicaEngine`` (``service.py``): the operations share its contexts, residency and records, and its
helpers for holding a context's gate (``_turn``), adopting a new context (``_adopt``, ``_made``) and running page
copies (``_run_copies``). A snapshot saved here is entered in the directory with its token lineage, so any replica
recomputes it where the pages are not (another replica, a replacement, or here after memory pressure let go of it).

What one user's snapshots hold here is bounded (``TenantLimits``): how many (``snapshots_per_user``) and the pages of
those the directory cannot recompute, whose loss under memory pressure would be final (``snapshot_pages_per_user``);
a save past either is refused with ``QuotaExceeded`` before anything is copied.
"""

from __future__ import annotations

from pie_workers.engine.contexts import ContextError
from pie_workers.engine.page_store import OutOfPages
from pie_workers.engine.record import EngineContext, Session
from pie_workers.engine.tenancy import QuotaExceeded
from pie_workers.wire.pages import pages_for


class SnapshotOperations:
    async def op_save(self, session: Session, ctx: int, name: str) -> None:
        async with self._turn(session, ctx) as state:
            self._check_snapshot_quota(session, state)
            await self.residency.restore_for_snapshot(state)
            copies = self.contexts.save(ctx, name)
        await self._run_copies(copies)
        await self._register(session, name)

    async def op_snapshot(self, session: Session, ctx: int) -> str:
        async with self._turn(session, ctx) as state:
            self._check_snapshot_quota(session, state)
            await self.residency.restore_for_snapshot(state)
            name, copies = self.contexts.snapshot(ctx)
        await self._run_copies(copies)
        await self._register(session, name)
        return name

    async def op_keep(self, session: Session, ctx: int, name: str) -> None:
        """Save the context as ``name`` and end it, by handing the snapshot its pages: no copy, so no batch to
        wait for (what a turn that ends by storing its conversation wants)."""
        async with self._turn(session, ctx) as state:
            self._check_snapshot_quota(session, state)
            await self.residency.restore(state)
            view = self.contexts.view(ctx)
            working = view.page_ids[len(view.page_ids) - view.working_pages :]
            self.records.keep(state, name)
        self.scheduler.withdraw(set(working), ContextError(f"context {ctx} was kept as snapshot {name!r}"))
        await self._register(session, name)

    def _check_snapshot_quota(self, session: Session, state: EngineContext) -> None:
        """Refuse a snapshot of the context that would take its user past the snapshots or pages one user may
        hold on this replica."""
        limits, user = self.tenants, session.username
        count, held = self.contexts.snapshot_usage(user)
        if count >= limits.snapshots_per_user:
            raise QuotaExceeded(
                f"user {user!r} holds {count} snapshots on this replica: [limits] snapshots_per_user = "
                f"{limits.snapshots_per_user} (delete one first)"
            )
        most = limits.snapshot_pages_per_user or self.store.num_pages // 2
        if self.directory is not None and (state.suspended is not None or self.contexts.recomputable(state.id)):
            return  # it will be mirrored: its pages yield to whoever needs them
        pages = pages_for(self.residency.seq_len(state), self.store.page_size)
        if held + pages > most:
            raise QuotaExceeded(
                f"a snapshot of {pages} pages would take user {user!r}'s snapshots to {held + pages} KV pages on this "
                f"replica: [limits] snapshot_pages_per_user = {most}"
                + ("" if limits.snapshot_pages_per_user else " (half its pool, by default)")
            )

    async def _register(self, session: Session, name: str) -> None:
        """Enter a snapshot just saved here in the cluster's directory; a name another replica holds is refused
        there as it would be here (and the copy just made is dropped)."""
        if self.directory is None:
            return
        lineage = self.contexts.snapshot_text(session.username, name)
        try:
            registered = await self.directory.register(session.username, name, lineage)
        except BaseException:  # refused there (``snapshots_per_user``), or no answer: not kept here either
            self.contexts.delete(session.username, name)
            raise
        if not registered:
            self.contexts.delete(session.username, name)
            raise ContextError(f"snapshot {name!r} already exists for user {session.username!r}")
        if lineage is not None:  # recomputable from there: memory may be taken back from it here
            self.contexts.mirrored(session.username, name)

    async def op_open(self, session: Session, name: str, known: int = -1) -> dict | None:
        """A copy of the snapshot; born suspended (recomputed on its first pass) when memory is short, or when
        the snapshot was saved on another replica (recomputed from the lineage the directory keeps)."""
        lookup = self.directory and self.directory.lookup
        self.contexts.check_not_let_go(session.username, name)
        try:
            pages = self.contexts.view_snapshot(session.username, name).working_pages
        except ContextError:
            return await self._from_elsewhere(session, name, lookup, known)
        text = None
        if self.residency.try_now(None, pages):
            opened = self.contexts.open(session.username, name, session.key)
            if opened is None:  # making room let go of this very snapshot: the directory has its lineage
                return await self._from_elsewhere(session, name, lookup, known)
            ctx, copies = opened
        else:
            text = self.contexts.snapshot_text(session.username, name)
            if text is None:
                raise OutOfPages(pages, self.store.available, self.store.num_pages)
            namespace = self.contexts.snapshot_namespace(session.username, name)  # it shares the snapshot's pages
            ctx, copies = self.contexts.create(session.username, session.key, namespace), []
        state = self._adopt(session, ctx, new_pages=True)
        if text is not None:
            self.residency.add_suspended(state, *text)
        await self._run_copies(copies)
        return self._made(state, known, text is not None or self.contexts.recomputable(ctx))

    async def op_take(self, session: Session, name: str, known: int = -1) -> dict | None:
        self.contexts.check_not_let_go(session.username, name)
        ctx = self.contexts.take(session.username, name, session.key)
        if ctx is None:
            return await self._from_elsewhere(session, name, self.directory and self.directory.remove, known)
        if self.directory is not None:
            await self.directory.remove(session.username, name)
        return self._made(self._adopt(session, ctx), known, self.contexts.recomputable(ctx))

    async def _from_elsewhere(self, session: Session, name: str, ask, known: int) -> dict | None:
        """A snapshot this replica does not hold, from its lineage in the directory (``ask``: look it up, or
        take it); a context that is recomputed on its first pass. None if the name is unknown."""
        lineage = await ask(session.username, name) if ask else None
        if lineage is None:
            return None
        text, committed = lineage
        if text is None:
            raise ContextError(
                f"snapshot {name!r} is held by another replica and was written under a custom attention mask, an "
                "adapter or a zo seed, so it cannot be recomputed here"
            )
        state = self.records.create(session)
        self.residency.add_suspended(state, [tuple(t) for t in text], committed)
        return self._made(state, known)

    async def op_delete(self, session: Session, name: str) -> None:
        try:
            self.contexts.delete(session.username, name)
        except ContextError:
            if self.directory is None or await self.directory.remove(session.username, name) is None:
                raise
            return
        if self.directory is not None:
            await self.directory.remove(session.username, name)
