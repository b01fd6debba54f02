"""What a request leaves in its context once its batch ends, as functions over the table and the record: the
lineage of what it wrote, its full pages committed, empty pages given back.

Rejected drafts are rolled back here, so KV, ``seq_len`` and lineage always agree. Passes, chained steps, steps run
ahead and restores all settle this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pie_workers.engine.contexts import ContextTable
from pie_workers.engine.holding import ContextView
from pie_workers.engine.record import EngineContext
from pie_workers.wire.batch import ForwardRequest, RequestOutput
from pie_workers.wire.pages import pages_for

if TYPE_CHECKING:
    from pie_workers.engine.residency import Residency


def settle(
    table: ContextTable,
    record: EngineContext,
    request: ForwardRequest,
    out: RequestOutput,
    hold: int,
    salt: bytes,
    trim_pages: bool = True,
) -> RequestOutput:
    """Record what the request wrote (inputs and accepted drafts) under ``salt``, give back pages it left empty
    (unless ``trim_pages`` is False), and commit full pages except those touching the last ``hold`` tokens; a failed
    request raises its error."""
    ctx = record.id
    if out.error is None:
        tokens, drafts = request.token_ids, request.draft_tokens
        accepted = len(out.tokens) - 1 if drafts else 0
        written = tokens + drafts[:accepted] if accepted else tokens
        positions = request.positions + request.draft_positions[:accepted] if accepted else request.positions
        table.record(ctx, written, positions, salt)
        if record.drafts is not None:
            record.drafts.extend(written)
    view = table.view(ctx)
    if trim_pages or out.error is not None:
        trim(table, ctx, view)  # committing full pages below leaves the count of empty ones as it is
    if out.error is not None:
        raise ValueError(out.error)
    commit_full(table, ctx, hold, view)
    return out


def commit_full(table: ContextTable, ctx: int, hold: int, view: ContextView | None = None) -> None:
    """Commit the context's full working pages but those touching its last ``hold`` tokens."""
    view = view or table.view(ctx)
    if full := max(0, view.working_tokens - hold) // table.page_size:
        table.commit(ctx, full)


def trim(table: ContextTable, ctx: int, view: ContextView | None = None) -> None:
    """Give back working pages that hold no tokens (after a rejected draft, a failed pass, or a truncate).
    ``view``: the context as it is now, when the caller has it."""
    view = view or table.view(ctx)
    spare = view.working_pages - pages_for(view.working_tokens, table.page_size)
    if spare > 0:
        table.release_working(ctx, spare)


def truncate(table: ContextTable, residency: Residency, record: EngineContext, n: int) -> None:
    """Cut the context's last ``n`` tokens (only uncommitted ones can go)."""
    record.drafts = None
    record.sampled = None
    if record.suspended is not None:  # no need to recompute what is cut
        residency.truncate(record, n)
    else:
        table.truncate(record.id, n)
        trim(table, record.id)
