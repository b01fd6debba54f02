"""The runtime's n-gram drafter (``system_speculation=True``): prompt-lookup drafts from a context's own text.

After a step, the context's text ends with the token just sampled. The drafter finds the latest earlier place where
the text's last n tokens (n = 3, then 2, then 1) occurred and proposes what followed there. Repetitive text —
code, lists, quoted passages, chat turns echoing the prompt — drafts well; the replica verifies every draft, so a
bad guess costs only a few extra rows in the batch, never a wrong token.

The index is per context and incremental: each new token registers the n-grams ending just before it. A context is
indexed only once it asks for drafts; truncation, destruction or any change the drafter did not see (detected by
length) drops the index, and it is rebuilt from the context's tokens on the next request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie_workers.engine.record import EngineContext

MAX_NGRAM = 3


class NgramIndex:
    """A context's index (its ``EngineContext.drafts``): its tokens, and where each n-gram of them last ended."""

    __slots__ = ("text", "follows")

    def __init__(self, tokens: list[int]) -> None:
        self.text: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> index just after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Tokens whose KV a forward pass just wrote into the context."""
        text, follows = self.text, self.follows
        for t in tokens:
            end = len(text)  # the n-grams ending at end - 1 are followed by the token landing at `end`
            for n in range(1, min(MAX_NGRAM, end) + 1):
                follows[tuple(text[end - n : end])] = end
            text.append(int(t))

    def draft(self, next_token: int, k: int) -> list[int]:
        """Up to ``k`` tokens expected after ``next_token`` (sampled, not yet in the context's KV)."""
        seq = self.text
        for n in range(min(MAX_NGRAM, len(seq) + 1), 0, -1):
            key = (*seq[len(seq) - n + 1 :], next_token)
            # the occurrence ending at the last token is followed by next_token itself, so it is not indexed yet
            start = len(seq) if len(seq) >= n and tuple(seq[len(seq) - n :]) == key else self.follows.get(key)
            if start is not None:
                return _copy_forward(seq, next_token, start, k)
        return []


def _copy_forward(seq: list[int], next_token: int, start: int, k: int) -> list[int]:
    """``k`` tokens of ``seq + [next_token]`` from ``start`` on; running past the end continues with the copy itself
    (an LZ77-style overlapping copy), so a repeating pattern drafts its continuation in full."""
    out: list[int] = []
    for i in range(start, start + k):
        if i < len(seq):
            out.append(seq[i])
        elif i == len(seq):
            out.append(next_token)
        else:
            out.append(out[i - len(seq) - 1])
    return out


def draft(record: EngineContext, tokens: Callable[[], list[int]], length: int, next_token: int, k: int) -> list[int]:
    """Up to ``k`` drafts after ``next_token`` for a context holding ``length`` tokens; its index is (re)built from
    ``tokens()`` when it has none or one that missed a change."""
    index = record.drafts
    if index is None or len(index.text) != length:
        index = record.drafts = NgramIndex(tokens())
    return index.draft(next_token, k)
