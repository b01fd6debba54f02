"""Test helper: drives a ModelRunner the way the replica engine does — pages per sequence, kv_len, drafts.

It is deliberately tiny (no prefix sharing, no scheduling); it exists so runner tests can talk in sequences.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pie_workers.runner import ModelRunner
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, RequestOutput, Slot, SlotKind
from pie_workers.wire.pages import pages_for


class PageAllocator:
    """Hands out pool pages in a shuffled order so sequences never get contiguous pages."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "test pool too small"
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclass
class Seq:
    tokens: list[int]  # prompt, then generated tokens appended
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0

    def pending(self) -> list[int]:
        return self.tokens[self.kv_len :]


def request_for(seq: Seq, alloc: PageAllocator, page_size: int, slots=None, **kw) -> ForwardRequest:
    """A request that feeds ``seq``'s not-yet-cached tokens and samples greedily at the last one."""
    pending = seq.pending()
    n_drafts = len(kw.get("draft_tokens", []))
    need = pages_for(seq.kv_len + len(pending) + n_drafts, page_size)
    seq.pages += alloc.take(need - len(seq.pages)) if need > len(seq.pages) else []
    if slots is None:
        slots = [(len(pending) - 1, Slot.argmax())]
    return ForwardRequest(
        token_ids=pending,
        positions=list(range(seq.kv_len, seq.kv_len + len(pending))),
        page_ids=list(seq.pages),
        kv_len=seq.kv_len,
        slots=slots,
        **kw,
    )


def greedy_step(runner: ModelRunner, seqs: list[Seq], alloc: PageAllocator) -> list[RequestOutput]:
    """One batched step over all sequences: each gets its next greedy token appended."""
    reqs = [request_for(s, alloc, runner.page_size) for s in seqs]
    outs = runner.execute(ForwardBatch(reqs))
    for s, r, o in zip(seqs, reqs, outs, strict=True):
        assert o.error is None, o.error
        s.kv_len += len(r.token_ids)
        s.tokens.append(o.slots[0].token)
    return outs


def greedy_generate(runner: ModelRunner, prompt: list[int], n: int, alloc: PageAllocator) -> list[int]:
    seq = Seq(list(prompt))
    for _ in range(n):
        greedy_step(runner, [seq], alloc)
    return seq.tokens[len(prompt) :]


LOGITS = Slot(SlotKind.LOGITS)
