"""A ``forward`` request and its answer as they travel between the SDK and the replica.

The channel carries every operation's arguments as a positional list (see ``channel``). A forward's list is long and
grows at its end, so the engine takes it apart in one place, ``PassArgs.from_wire``, in the order the SDK's
``Forward._send`` writes it; ``PassReply.to_wire`` is the list ``Forward._finish`` unpacks. The other operations take
few arguments: their handlers' parameters, in order (see ``ReplicaEngine``'s table of operations). ``forward_request``
turns a pass into the runner's ``ForwardRequest``.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from pie_workers.wire.batch import ForwardRequest


@dataclass(slots=True)
class PassArgs:
    """A ``forward`` operation's arguments.

    A ``chained`` pass (a list of stop ids, maybe empty) takes as its input the token the context's previous pass
    sampled (the end of its verified walk, else its first token slot's), so a Generator can send step k + 1 before
    it has read step k: the inferlet's round trip then overlaps the batches instead of adding to them. ``tokens``
    must be empty and ``positions`` hold that token's position. When the token is one of the stop ids, nothing
    runs and the answer is None; when the previous pass failed or sampled nothing, this one fails too. A chained
    pass may run several ``steps``, each on the token the step before sampled, ending after a step that samples a
    stop id; its answer is the last step's, with every step's token as the walk. It takes no attention masks or
    drafts, commits its pages when it ends, and is all or nothing: a failed step undoes the steps before it.

    A plain pass (one step, samplers and probes on its last row only, no masks, drafts, adapter or zo seed) may ask
    for the next step ``ahead`` (a list of stop ids): once it is answered, the replica runs the next step on the
    token it sampled, unless that is a stop id, into the KV past the context's end. A request for exactly that step
    (the token, the next position, the same slots) is then answered from it when its batch ends, so an inferlet
    stepping token by token has its round trip overlap the batches; anything else on the context drops it.

    Full pages are committed (shared through the prefix trie) right away, except pages touching the last ``hold``
    tokens: a Generator holds back accepted drafts it may still cut at a stop token. ``draft_masks`` gives each
    draft row its own logit mask (a grammar's, after that draft). ``adapter`` (an id from
    ``adapter_create``/``adapter_open``) applies to every row; ``zo_seed`` perturbs it for this pass. With a
    ``draft_budget``, up to that many n-gram drafts for the next step come back (``system_speculation``). A ``bid``
    (a Generator's default) is the context's bid from this pass on, as ``set_bid`` would make it.
    """

    ctx: int
    tokens: list[int]
    positions: list[int]
    slots: list  # [row, slot on the wire] per sampled or probed row
    attention_masks: list[list[int]] | None
    logit_mask: bytes | None
    drafts: list[int]
    draft_positions: list[int]
    hold: int = 0
    adapter: int | None = None
    zo_seed: int | None = None
    draft_masks: list[bytes] | None = None
    draft_budget: int = 0
    bid: float | None = None
    chained: list[int] | None = None
    steps: int = 1
    ahead: list[int] | None = None

    @classmethod
    def from_wire(cls, args: list) -> PassArgs:
        """The arguments as ``Forward._send`` lists them; trailing ones left out take their defaults. A list of the
        wrong length is refused here, as a call with the wrong arguments would be (TypeError). The checks of their
        values wait for the pass's turn (``check``): a malformed pass then fails in its place among the context's
        passes, as any failing pass does."""
        if not _REQUIRED <= len(args) <= _FIELDS:
            raise TypeError(f"a forward takes {_REQUIRED} to {_FIELDS} arguments, got {len(args)}")
        (
            ctx, tokens, positions, slots, attention_masks, logit_mask, drafts, draft_positions,
            hold, adapter, zo_seed, draft_masks, draft_budget, bid, chained, steps, ahead,
        ) = args if len(args) == _FIELDS else [*args, *_DEFAULTS[len(args) - _REQUIRED :]]  # fmt: skip
        return cls(
            ctx=ctx,
            tokens=tokens,
            positions=positions,
            slots=slots,
            attention_masks=attention_masks,
            logit_mask=logit_mask,
            drafts=drafts,
            draft_positions=draft_positions,
            hold=hold,
            adapter=adapter,
            zo_seed=zo_seed,
            draft_masks=draft_masks,
            draft_budget=draft_budget,
            bid=bid,
            chained=chained,
            steps=steps,
            ahead=ahead,
        )

    def check(self) -> None:
        """Refuse what no context could run: steps, a step ahead or input tokens where the pass's kind takes none."""
        if self.ahead is not None and (self.chained is not None or self.steps != 1 or not isinstance(self.ahead, list)):
            raise ValueError(f"only a plain pass of one step takes stop ids to run the next step ahead: {self.ahead!r}")
        if self.steps != 1:
            if self.chained is None or not isinstance(self.steps, int) or self.steps < 1:
                raise ValueError(f"a pass runs one step, a chained pass one or more: got {self.steps!r} steps")
            if self.attention_masks is not None or self.drafts:
                raise ValueError("a chained pass of several steps takes no attention masks or drafts")
        if self.chained is not None and self.tokens:
            raise ValueError("a chained pass takes its input from the previous pass: send no tokens")

    def plain(self) -> bool:
        """A pass a step run ahead can stand for, and run after: one step of tokens alone (no masks, drafts, adapter
        or zo seed)."""
        return (
            self.chained is None
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


_FIELDS = len(fields(PassArgs))
_DEFAULTS = tuple(f.default for f in fields(PassArgs) if f.default is not MISSING)
_REQUIRED = _FIELDS - len(_DEFAULTS)


@dataclass(slots=True, eq=False)
class PassReply:
    """A pass's answer (a chained pass that stopped answers None instead)."""

    slots: list  # each slot's output, on the wire
    walk: list[int]  # the verified walk (accepted drafts and the bonus token), or a chained pass's every step's token
    seq_len: int  # the context's length after the pass
    next_drafts: list[int]  # n-gram drafts for the next step (``draft_budget``)

    def to_wire(self) -> list:
        return [self.slots, self.walk, self.seq_len, self.next_drafts]


@dataclass(frozen=True, slots=True)
class PassBinding:
    """What a forward runs under besides its tokens: the salt its KV is hashed with, the adapter and zo seed."""

    salt: bytes = b""
    adapter: int | None = None
    zo_seed: int | None = None


PLAIN_PASS = PassBinding()


def forward_request(
    a: PassArgs, bind: PassBinding, *, tokens, positions, slots, attention_masks, page_ids, kv_len
) -> ForwardRequest:
    """The runner's request for a pass's rows: the given inputs, with the pass's logit mask, drafts and adapter."""
    return ForwardRequest(
        token_ids=tokens,
        positions=positions,
        page_ids=page_ids,
        kv_len=kv_len,
        slots=slots,
        attention_masks=attention_masks,
        logit_mask=a.logit_mask,
        draft_tokens=a.drafts,
        draft_positions=a.draft_positions,
        draft_masks=a.draft_masks,
        adapter=bind.adapter,
        zo_seed=bind.zo_seed,
    )
