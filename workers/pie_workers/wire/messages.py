"""The messages inferlets and a replica's engine exchange, as dataclasses both sides import.

On the channel a message is a msgpack map of its fields by name, leaving out those at their defaults (a decode
step of a Generator then carries a handful of keys, not all of them). ``decode`` refuses a field the message does
not define and names one that is missing, so a message from a newer or older peer fails loudly instead of being
read into the wrong fields. Samplers and slot outputs inside a pass travel in their compact forms (``codec.py``).

Operations other than ``forward`` take their few arguments in order (the engine's handlers' parameters); their
answers are ``ContextReply``, ``AdapterReply`` and ``AccountReply``, or a plain value (an id, a length, a name).
A replica that left answers with a ``MovedNotice`` (the error ``ReplicaMoved``), and ``claim`` takes ``Claim``s.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, TypeVar

Message = TypeVar("Message")

MAX_CACHE_SALT = 256  # characters of the salt a context is created with (``create``'s argument, vLLM's cache_salt)


class PassKind(enum.StrEnum):
    INPUT = "input"  # runs the tokens it carries
    CHAINED = "chained"  # runs on the token the context's previous pass sampled (see ``PassRequest``)


@dataclass(slots=True)
class PassRequest:
    """A ``forward``: one pass over a context.

    An ``INPUT`` pass runs ``tokens`` at ``positions``. A ``CHAINED`` pass takes as its input the token the
    context's previous pass sampled (the end of its verified walk, else its first token slot's), so a Generator can
    send step k + 1 before it has read step k: the inferlet's round trip then overlaps the batches instead of adding
    to them. It carries no tokens, and ``positions`` holds that token's position. When the token is one of the
    ``stop_ids``, nothing runs and the answer is None; when the previous pass failed or sampled nothing, this one
    fails too. It may run several ``steps``, each on the token the step before sampled, ending after a step that
    samples a stop id; its answer is the last step's, with every step's token as the walk. It takes no attention
    masks or drafts, commits its pages when it ends, and is all or nothing: a failed step undoes the steps before.

    A plain pass (input tokens, one step, samplers and probes on its last row only, no masks, drafts, adapter or zo
    seed) may ask to ``run_ahead``: once it is answered, the replica runs the next step on the token it sampled,
    unless that is one of the ``stop_ids``, into the KV past the context's end. A request for exactly that step (the
    token, the next position, the same slots) is then answered from it when its batch ends; anything else on the
    context drops it.

    Full pages are committed (shared through the prefix trie) right away, except pages touching the last ``hold``
    tokens: a Generator holds back accepted drafts it may still cut at a stop token. ``draft_masks`` gives each
    draft row its own packed logit mask (a grammar's, after that draft). ``adapter`` (an id from
    ``adapter_create``/``adapter_open``) applies to every row; ``zo_seed`` perturbs it for this pass. With a
    ``draft_budget``, up to that many n-gram drafts for the next step come back. A ``bid`` (a Generator's default)
    is the context's bid from this pass on, as ``set_bid`` would make it.

    ``known``: how many of the context's tokens the inferlet has mirrored (-1: it keeps no mirror). Its answer then
    carries the context's tokens from there on (``Lineage``), so that the inferlet can have the context recomputed
    on another replica if this one dies.
    """

    ctx: int
    kind: PassKind = PassKind.INPUT
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list = field(default_factory=list)  # [row, sampler or probe on the wire] per sampled or probed row
    attention_masks: list[list[int]] | None = None  # one BRLE row per input token
    logit_mask: bytes | None = None  # packed BRLE over the vocabulary, at every sampled row
    drafts: list[int] = field(default_factory=list)
    draft_positions: list[int] = field(default_factory=list)
    draft_masks: list[bytes] | None = None
    draft_budget: int = 0
    hold: int = 0
    adapter: int | None = None
    zo_seed: int | None = None
    bid: float | None = None
    steps: int = 1
    stop_ids: list[int] = field(default_factory=list)
    run_ahead: bool = False
    known: int = -1

    @property
    def chained(self) -> bool:
        return self.kind == PassKind.CHAINED

    def check(self) -> None:
        """Refuse what no context could run: an unknown kind, steps, a step ahead or input tokens where the
        pass's kind takes none. (Checked at the pass's turn, so a malformed pass fails in its place among the
        context's passes, as any failing pass does.)"""
        if self.kind not in _KINDS:
            raise ValueError(f"unknown pass kind {self.kind!r}: one of {', '.join(_KINDS)}")
        if not isinstance(self.stop_ids, list):
            raise ValueError(f"stop_ids must be a list of token ids, got {self.stop_ids!r}")
        if self.run_ahead and (self.chained or self.steps != 1):
            raise ValueError("only a plain pass of one step can run the next step ahead")
        if self.steps != 1:
            if not self.chained or not isinstance(self.steps, int) or self.steps < 1:
                raise ValueError(f"a pass runs one step, a chained pass one or more: got {self.steps!r} steps")
            if self.attention_masks is not None or self.drafts:
                raise ValueError("a chained pass of several steps takes no attention masks or drafts")
        if self.chained and self.tokens:
            raise ValueError("a chained pass takes its input from the previous pass: send no tokens")
        if not isinstance(self.known, int) or isinstance(self.known, bool) or self.known < -1:
            raise ValueError(f"known must be a token count >= 0, or -1 for none, got {self.known!r}")

    def plain(self) -> bool:
        """A pass a step run ahead can stand for, and run after: one step of tokens alone (no masks, drafts,
        adapter or zo seed)."""
        return (
            not self.chained
            and self.attention_masks is None
            and self.logit_mask is None
            and not self.drafts
            and self.draft_budget == 0
            and self.adapter is None
            and self.zo_seed is None
        )

    def held(self) -> int:
        """Tokens at the end whose pages the pass leaves uncommitted: ``hold``, and a chained pass of several steps
        keeps all it may write until it ends, so that it can undo them."""
        return self.hold + self.steps if self.steps > 1 else self.hold


_KINDS = frozenset(kind.value for kind in PassKind)  # as they come off the wire: plain strings


@dataclass(slots=True)
class PassReply:
    """A pass's answer (a chained pass that stopped at a stop id answers None instead)."""

    seq_len: int  # the context's length after the pass
    slots: list = field(default_factory=list)  # each slot's output, on the wire
    walk: list[int] = field(default_factory=list)  # a verified draft run's accepted drafts and bonus token, or a
    # chained pass's every step's token; empty for any other pass
    next_drafts: list[int] = field(default_factory=list)  # n-gram drafts for the next step (``draft_budget``)
    tail: list[int] = field(default_factory=list)  # the context's last tokens, from the request's ``known`` on
    tail_positions: list[int] = field(default_factory=list)  # their positions


@dataclass(slots=True)
class ContextReply:
    """A context made by ``fork``, ``open``, ``take`` or ``restore``; for an inferlet that mirrors lineage, its
    tokens from the ``known`` it asked with on (``recomputable`` False: it holds KV written under a custom mask, an
    adapter or a zo seed, so no mirror could rebuild it)."""

    ctx: int
    seq_len: int
    tail: list[int] = field(default_factory=list)
    tail_positions: list[int] = field(default_factory=list)
    recomputable: bool = True


@dataclass(slots=True)
class Claim:
    """One context a ``claim`` asks for: its id on the replica that left (``MovedNotice``), and ``known`` as in a
    ``fork`` (its tokens from there on come back with it; -1: none)."""

    ctx: int
    known: int = -1


@dataclass(slots=True)
class MovedNotice:
    """What a replica that left answers every request with: it handed its contexts (their KV pages, not their
    tokens) to the replica listening at ``addresses``, where a ``claim`` of their old ids gets them back as they
    were. ``source``: the replica that left, as its logs name it."""

    source: str
    addresses: list[str]


@dataclass(slots=True)
class AdapterReply:
    """A LoRA adapter as ``adapter_create``, ``adapter_open``, ``adapter_fork`` and ``adapter_load`` leave it."""

    id: int
    rank: int
    alpha: float
    targets: list[str]


@dataclass(slots=True)
class AccountReply:
    """What ``inferlet.scheduling`` reads of the inferlet's process on a replica with a market."""

    balance: float
    endowment: float
    dividend: float  # received in the latest rounds
    paid: float  # rent paid in the latest rounds
    page_cost: float  # credits per new page
    price: float  # this device's clearing price
    latency: float  # its batch latency, seconds


def encode(message: Any) -> dict:
    """The message as a map of its fields by name, without those at their defaults."""
    out = {}
    for name, default in _defaults(type(message)):
        value = getattr(message, name)
        if default is _REQUIRED or value != default:
            out[name] = value
    return out


def decode(cls: type[Message], data: Any) -> Message:
    """The message ``cls`` from its map; a ValueError names a field it does not define or one it misses."""
    if not isinstance(data, dict):
        raise ValueError(f"a {cls.__name__} travels as a map of its fields, got {type(data).__name__}")
    try:
        return cls(**data)
    except TypeError:
        names = {name for name, _ in _defaults(cls)}
        unknown = sorted(map(str, data.keys() - names))
        missing = sorted(name for name, default in _defaults(cls) if default is _REQUIRED and name not in data)
        problem = f"unknown fields {unknown}" if unknown else f"missing fields {missing}"
        raise ValueError(f"malformed {cls.__name__}: {problem}") from None


_REQUIRED = object()


@functools.cache
def _defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field's name and default (a factory's product; ``_REQUIRED`` for a field without one)."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, f.default_factory()))
        else:
            out.append((f.name, _REQUIRED))
    return tuple(out)
