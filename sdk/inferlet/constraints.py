"""Constraints on what a Generator may produce, and how several of them compose into one logit mask per step.

A ``Constraint`` is anything with ``step(accepted) -> BRLE``: it is told the tokens accepted since its last call
(``[]`` on the first) and returns the mask for the next position (``[]`` = no restriction). A ``Schema`` is anything
with ``build_constraint(model)``; the four declarative ones (``AnyJson``, ``JsonSchema``, ``Regex``, ``Ebnf``) and
``Grammar`` build a ``GrammarConstraint`` (in ``inferlet.grammar``, beside the ``Matcher`` it walks). A constraint
may also expose ``is_terminated``: once true, the Generator stops (so it never samples from an all-false mask, which
is what Pie's Generator does when the stop set lacks the grammar's stop token). A constraint with ``rollback(n)``
(undo its last n accepted tokens) works with speculation: each draft is verified under the mask the constraint gives
after the drafts before it. Without it, a constrained Generator drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pie_workers.wire import brle

from inferlet.grammar import GrammarConstraint
from inferlet.instruct import ModelLike


@runtime_checkable
class Constraint(Protocol):
    def step(self, accepted: list[int]) -> list[int]:
        """Advance past ``accepted``; return the BRLE mask of the tokens allowed next ([] = no restriction)."""
        ...


@runtime_checkable
class Schema(Protocol):
    def build_constraint(self, model: ModelLike) -> Constraint:
        """A fresh constraint for this model (constraints are stateful: one per generation)."""
        ...


@dataclass(frozen=True)
class AnyJson:
    """Any JSON value (compact unless ``any_whitespace``)."""

    any_whitespace: bool = False

    def build_constraint(self, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.json(model, any_whitespace=self.any_whitespace)


@dataclass(frozen=True)
class JsonSchema:
    """JSON conforming to a JSON Schema (text or dict; compact unless ``any_whitespace``)."""

    schema: str | dict
    any_whitespace: bool = False

    def build_constraint(self, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.from_json_schema(self.schema, model, any_whitespace=self.any_whitespace)


@dataclass(frozen=True)
class Regex:
    """Text matching the whole regular expression."""

    pattern: str

    def build_constraint(self, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.from_regex(self.pattern, model)


@dataclass(frozen=True)
class Ebnf:
    """Text in the language of an EBNF grammar (Lark syntax, or GBNF with ``root ::= ...``)."""

    source: str

    def build_constraint(self, model: ModelLike) -> GrammarConstraint:
        return GrammarConstraint.from_ebnf(self.source, model)


class _FixedMask:
    """A static logit mask as a constraint, so ``logit_mask=`` composes like any other."""

    def __init__(self, mask: list[int]) -> None:
        brle.validate(mask, "logit_mask")
        self._mask = list(mask)

    def step(self, accepted: list[int]) -> list[int]:
        return self._mask

    def rollback(self, n: int) -> None:
        pass  # stateless


class ConstraintSet:
    """The constraints on one generation, composed: one AND-ed mask per step, and which tokens they admit.

    Constraints are stepped lazily, once per position, with the tokens admitted since: the mask a step sends is
    computed when the step (or a termination check) needs it. ``admit`` reconciles tokens with the constraints: it
    keeps the longest prefix that the composed mask allows token by token (a multi-token accept, e.g. verified
    drafts, is cut where a constraint would refuse), so a constraint is only ever stepped with tokens it allowed.
    """

    def __init__(self, model: ModelLike) -> None:
        self._model = model
        self._items: list[Constraint] = []
        self._masks: list[list[int]] = []  # each constraint's mask for the next position
        self._pending: list[int] = []  # admitted since the constraints were last stepped
        self._composed: list[int] | None = None
        self._fresh = True  # _composed matches _masks

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, c: Schema | Constraint | list[Schema | Constraint]) -> None:
        """Attach a constraint, a schema (built for the model now, so bad input fails here), or a list of them."""
        if isinstance(c, (list, tuple)):
            for one in c:
                self.add(one)
            return
        if isinstance(c, Schema):
            c = c.build_constraint(self._model)
        if not isinstance(c, Constraint):
            raise TypeError(
                f"constrain= takes a Schema (build_constraint(model)) or a Constraint (step(accepted)), "
                f"got {type(c).__name__}"
            )
        self._advance()  # older constraints catch up first: the new one starts here, with step([])
        self._masks.append(list(c.step([])))
        self._items.append(c)
        self._fresh = False

    def add_mask(self, mask: list[int]) -> None:
        """Attach a static BRLE logit mask."""
        self.add(_FixedMask(mask))

    def mask(self) -> list[int] | None:
        """The AND of every constraint's mask for the next position; None when nothing restricts it."""
        self._advance()
        if not self._fresh:
            restricting = [m for m in self._masks if m]
            if len(restricting) > 1:
                self._composed = brle.and_many(restricting)
            else:  # one mask (the usual case) is the composition: _advance already made it our own copy
                self._composed = restricting[0] if restricting else None
            self._fresh = True
        return self._composed

    def step_mask(self) -> list[int] | None:
        """The mask to send with the next forward pass; raises if the constraints leave no token to sample."""
        mask = self.mask()
        if mask is not None and not any(mask[1::2]):
            raise ValueError("the attached constraints allow no token at this step (their masks AND to nothing)")
        return mask

    def admit(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the constraints allow, which they will be stepped with."""
        if not self._items:
            return tokens
        kept: list[int] = []
        for t in tokens:
            mask = self.mask()
            if mask is not None and not brle.allows(mask, t):
                break
            kept.append(t)
            self._pending.append(t)
        return kept

    def lookahead(self, drafts: list[int]) -> tuple[list[int], list[list[int]] | None]:
        """For speculation: the longest prefix of ``drafts`` the constraints allow in sequence, and the mask each
        kept draft's verification row needs (the composed mask after that draft; ``[]`` = unrestricted, also where
        it would allow nothing — whatever is sampled there is cut by ``admit``). The constraints end as they began.
        Without constraints: ``(drafts, None)``; with one that cannot roll back: no drafts."""
        if not self._items or not drafts:
            return drafts, None
        if not all(callable(getattr(c, "rollback", None)) for c in self._items):
            return [], None
        self._advance()
        saved = self._masks, self._composed, self._fresh
        kept: list[int] = []
        row_masks: list[list[int]] = []
        try:
            for t in drafts:
                mask = self.mask()
                if mask is not None and not brle.allows(mask, t):
                    break
                self._masks, self._fresh = [list(c.step([t])) for c in self._items], False
                kept.append(t)
                after = self.mask()
                row_masks.append(after if after is not None and any(after[1::2]) else [])
        finally:
            for c in self._items:
                c.rollback(len(kept))
            self._masks, self._composed, self._fresh = saved
        return kept, row_masks

    @property
    def terminated(self) -> bool:
        """Whether a constraint has ended (a grammar accepted its stop token)."""
        self._advance()
        return any(getattr(c, "is_terminated", False) for c in self._items)

    def _advance(self) -> None:
        if self._pending:
            accepted, self._pending = self._pending, []
            self._masks = [list(c.step(accepted)) for c in self._items]
            self._fresh = False
