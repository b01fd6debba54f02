"""Speculative decoding: the ``Speculator`` protocol a Generator drafts with (``speculator=``).

Each step the Generator asks ``draft()`` for tokens it expects next, with their positions: they must continue the
context in order, right after the step's input (the Generator raises otherwise). The replica verifies the drafts in
the same forward pass as the step and keeps the longest run its sampler agrees with, plus its own next token, so the
output is exactly what generation without drafts gives. The Generator then calls ``accept(tokens)`` with what the
step produced (the confirmed drafts, then the model's token) and ``rollback(n)`` with how many of the drafts were
not used. ``reset()`` is the speculator's own: the Generator never calls it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Speculator(Protocol):
    def draft(self) -> tuple[list[int], list[int]]:
        """(tokens, positions) expected next; ``([], [])`` to skip drafting this step."""
        ...

    def accept(self, tokens: list[int]) -> None:
        """The tokens this step produced."""
        ...

    def rollback(self, n: int) -> None:
        """The last ``n`` drafted tokens were rejected."""
        ...

    def reset(self) -> None:
        """Forget all state."""
        ...
