"""The inferlet's copy of what a context's KV holds, so that another replica can recompute the context if its own
replica dies (``inferlet._failover``).

A replica answers every pass, fork and open of a mirrored context with the context's tokens from the count the
inferlet already had (``known``) on, so the copy follows whatever the replica wrote: inputs, accepted drafts,
chained steps, rollbacks. Nothing is mirrored for a model without failover addresses (``ModelEndpoint.failover``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pie_workers.wire.codec import output_from_wire

SALTED = (
    "it holds KV written under a custom attention mask, an adapter or a zo seed, which no other replica can recompute"
)


@dataclass
class Lineage:
    """(token, position) of every token in a context's KV, and the token its latest pass sampled (the input of a
    pass chained on it). ``lost``: why no copy can rebuild the context; None while it can. ``cache_salt``: the one
    the context was made with, so that its recomputed pages are keyed as its old ones were."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sampled: int | None = None
    lost: str | None = None
    cache_salt: str = ""

    def known(self) -> int:
        """What a request tells the replica the copy holds (-1: keep no copy, send no tail)."""
        return -1 if self.lost else len(self.tokens)

    def lose(self, why: str) -> None:
        self.lost = why
        self.tokens, self.positions = [], []

    def extend(self, seq_len: int, tail: list[int], tail_positions: list[int]) -> None:
        """The context now holds ``seq_len`` tokens, the last of which are ``tail``."""
        if self.lost:
            return
        base = seq_len - len(tail)
        if base > len(self.tokens) or len(tail) != len(tail_positions):
            self.lose("its copy of the context's tokens fell behind the replica's")
            return
        del self.tokens[base:], self.positions[base:]
        self.tokens += tail
        self.positions += tail_positions

    def passed(self, answer: dict) -> None:
        """A pass's answer as it came off the wire (a ``PassReply`` map, its defaults left out: read here without
        decoding it, which the caller does later): its tail, and the token it sampled (as the replica remembers it
        for a chained pass)."""
        self.extend(answer["seq_len"], answer.get("tail", []), answer.get("tail_positions", []))
        if walk := answer.get("walk"):
            self.sampled = walk[-1]
        else:
            slots = answer.get("slots", [])
            self.sampled = next((t for s in slots if (t := output_from_wire(s).token) is not None), None)

    def cut(self, seq_len: int) -> None:
        """A truncate left ``seq_len`` tokens (and, as on the replica, no sampled token to chain on)."""
        del self.tokens[seq_len:], self.positions[seq_len:]
        self.sampled = None

    def child(self, seq_len: int, tail: list[int], tail_positions: list[int]) -> Lineage:
        """The copy of a fork made when the parent held ``seq_len`` tokens, ``tail`` the last of them."""
        if self.lost:
            return Lineage(lost=self.lost)
        child = Lineage(
            self.tokens[: seq_len - len(tail)], self.positions[: seq_len - len(tail)], cache_salt=self.cache_salt
        )
        child.extend(seq_len, tail, tail_positions)
        return child
