"""A context's or snapshot's KV as one replica hands it to another: the records of a handover, and reading a
holding's pages out of one pool and installing them in another.

A replica that leaves moves what it holds instead of letting it be recomputed (``handover.py``): each holding goes
as its tokens, positions and per-token salts (what its pages are keyed by in the prefix trie) with the bytes of every
page that holds a token, as the pool lays them out. The receiver adopts the prefix pages it already has cached,
copies the rest into fresh pages, then records and commits the tokens as the passes that wrote them did, so the
holding's pages hash, share and evict as they did at the source. Pages move only between pools of the same layout
(``KvLayout``): same backend and kernel variant, dtype, page shape and tensor-parallel size (each rank's share of
the KV heads goes to the rank of the same index).

The records cross between replicas over Ray (the KV tensor through its object store), never over an inferlet's
socket; ``Handover.check`` refuses one that is not what it says, naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import torch

from pie_workers.engine.contexts import ContextTable
from pie_workers.engine.holding import Holding
from pie_workers.runner import ModelRunner
from pie_workers.wire.pages import pages_for

_MIXED = b"\x00mixed"  # ``holding.page_salt``'s mark of a page whose tokens have different salts


@dataclass(frozen=True, slots=True)
class KvLayout:
    """How a replica's pages lie: only a pool laid out alike can take them as they are."""

    pool: str  # the pool's ``kv_layout`` (backend and kernel variant)
    dtype: str
    page_shape: tuple[int, ...]  # one page's KV as ``ModelRunner.read_pages`` gives it: ranks first


@dataclass(slots=True)
class HoldingState:
    """What a context or snapshot holds: every token with its position and salt, how many of them are committed,
    its namespace (whose cached pages it may share) and ``kv``, the pages holding its tokens (``[pages,
    *page_shape]``); None when none is resident (a suspended context: the receiver recomputes it from its text)."""

    tokens: list[int]
    positions: list[int]
    salts: list[bytes]
    committed: int
    namespace: bytes
    kv: torch.Tensor | None

    def check(self, page_size: int, layout: KvLayout) -> None:
        n = len(self.tokens)
        if len(self.positions) != n or len(self.salts) != n or not 0 <= self.committed <= n:
            raise ValueError(f"malformed HoldingState: {n} tokens, {len(self.positions)} positions, "
                             f"{len(self.salts)} salts, {self.committed} committed")  # fmt: skip
        if self.committed % page_size:
            raise ValueError(f"malformed HoldingState: {self.committed} committed tokens are not whole pages")
        if self.kv is not None and tuple(self.kv.shape) != (pages_for(n, page_size), *layout.page_shape):
            raise ValueError(f"malformed HoldingState: KV of shape {tuple(self.kv.shape)} for {n} tokens")


@dataclass(slots=True)
class MovedContext:
    """A live context: its holding and what the engine keeps beside it (``EngineContext``), and who holds it:
    ``session`` (``capability/session``, verified again by the receiver) and its id at the source."""

    session: str
    ctx: int
    holding: HoldingState
    salt: bytes = b""
    sampled: int | None = None
    bid: float = 0.0


@dataclass(slots=True)
class MovedSnapshot:
    owner: str
    name: str
    holding: HoldingState


@dataclass(slots=True)
class Handover:
    """Everything a leaving replica hands another in one Ray call."""

    source: str
    layout: KvLayout
    page_size: int
    contexts: list[MovedContext] = field(default_factory=list)
    snapshots: list[MovedSnapshot] = field(default_factory=list)

    def check(self, page_size: int, layout: KvLayout) -> None:
        """Refuse a handover this pool cannot take, or one whose parts are not the records they should be."""
        if self.page_size != page_size or self.layout != layout:
            raise ValueError(
                f"a handover from {self.source} of pages {self.layout} ({self.page_size} tokens) cannot be installed "
                f"in pages {layout} ({page_size} tokens)"
            )
        for kind, items in ((MovedContext, self.contexts), (MovedSnapshot, self.snapshots)):
            for item in items:
                if not isinstance(item, kind) or not isinstance(item.holding, HoldingState):
                    raise TypeError(f"malformed Handover: a {type(item).__name__} where a {kind.__name__} belongs")
                item.holding.check(page_size, layout)


@dataclass(frozen=True, slots=True)
class Adopted:
    """What the receiver installed: contexts by (session, id at the source), snapshots by (owner, name); and why
    each of the others was refused (they stay with the source, whose inferlets recompute them if it goes)."""

    contexts: list[tuple[str, int]]
    snapshots: list[tuple[str, str]]
    refused: list[str]


def layout_of(runner: ModelRunner) -> KvLayout:
    """This replica's page layout: its pool's, and how many ranks share each page's KV heads (a tensor-parallel
    group's pages move only to a group of the same size, rank to rank)."""
    page = runner.read_pages([0])
    return KvLayout(runner.kv.kv_layout, str(page.dtype).removeprefix("torch."), tuple(page.shape[1:]))


def read_holding(table: ContextTable, holding: Holding, runner: ModelRunner) -> HoldingState:
    """The holding's state with its resident pages' bytes; run after every queued copy into them (a barrier)."""
    text, committed = holding.text()
    salts = [salt for node in holding.chain_nodes() for salt in _unmixed(node.salt, len(node.tokens))]
    salts += [salt for _, _, salt in holding.lineage]
    pages = list(holding.view(table.store).page_ids[: pages_for(len(text), table.page_size)])
    kv = runner.read_pages(pages) if pages else None
    return HoldingState([t for t, _ in text], [p for _, p in text], salts, committed, holding.namespace, kv)


def place(table: ContextTable, ctx: int, state: HoldingState) -> tuple[int, list[int]]:
    """Give the empty context ``ctx`` its pages for ``state``: the committed prefix this pool has cached (adopted,
    when nothing in it is salted), then fresh pages for the rest. Returns the tokens adopted and the fresh pages,
    to be written (after a barrier: a page just freed may still have a move queued) by ``fill``."""
    plain = not any(state.salts[: state.committed])
    reused = (
        table.reuse_prefix(ctx, state.tokens[: state.committed], state.positions[: state.committed]) if plain else 0
    )
    need = pages_for(len(state.tokens), table.page_size) - len(table.view(ctx).page_ids)
    return reused, table.reserve(ctx, need)


def fill(table: ContextTable, ctx: int, state: HoldingState, reused: int, pages: list[int], runner: ModelRunner):
    """Write the pages ``place`` gave and record and commit the tokens in them, as the source had them."""
    if pages:
        runner.write_pages(pages, state.kv[reused // table.page_size :])
    start = reused
    for salt, run in groupby(state.salts[reused:]):
        end = start + len(list(run))
        table.record(ctx, state.tokens[start:end], state.positions[start:end], salt)
        start = end
    if full := (state.committed - reused) // table.page_size:
        table.commit(ctx, full)


def _unmixed(salt: bytes, n: int) -> list[bytes]:
    """Each token's salt of a committed page keyed with ``salt`` (``holding.page_salt``'s inverse)."""
    if not salt.startswith(_MIXED):
        return [salt] * n
    out, at = [], len(_MIXED)
    while at < len(salt):
        size = int.from_bytes(salt[at : at + 4], "little")
        part = salt[at + 4 : at + 4 + size]
        count = int.from_bytes(salt[at + 4 + size : at + 8 + size], "little")
        out += [part] * count
        at += 8 + size
    return out
