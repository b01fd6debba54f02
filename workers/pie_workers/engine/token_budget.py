"""The tokens each instance's passes have generated on this replica, held to the budget its capability grants.

The trusted side sets an instance's token budget and signs it into the instance's capability
(``Capability.token_budget``); the SDK inside the untrusted worker counts too, but only as a fast path. Here the
count is per instance across all its sessions on this replica, and kept until its capability expires, so reopening a
session starts nothing over. An instance that uses several replicas (failover, several models) is held to its full
budget on each of them: enforcement is per replica, with no central call per pass.

A pass that samples a token is refused once the budget is spent (one that only reads logits or distributions is
not), with the SDK's wording (``TokenBudgetExhausted``); a chained pass runs at most the steps left. A single pass may
still sample one token per sampler slot at once, so the count can end past the budget by that pass's slots, as the
SDK's own check allows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from pie_workers.engine.record import Session
from pie_workers.engine.tenancy import TokenBudgetExhausted
from pie_workers.wire.codec import slot_from_wire
from pie_workers.wire.messages import PassReply, PassRequest

PRUNE_AT = 4096  # instances counted past which those whose capability expired are forgotten


@dataclass(slots=True)
class _Spent:
    tokens: int
    expires: float  # its capability's: past it no request of the instance is admitted, so its count may go


class TokenBudgets:
    def __init__(self) -> None:
        self._spent: dict[str, _Spent] = {}  # instance -> what its passes generated here
        self._prune_at = PRUNE_AT

    def bound(self, session: Session, a: PassRequest, walk: list[int] | None) -> PassRequest:
        """The pass as it may run within the session's budget (``walk``: the tokens a chained pass generated so
        far, not yet counted): refused once the budget is spent, a chained pass cut to the steps left."""
        budget = session.grants.token_budget
        if budget is None or not (a.chained or any(slot_from_wire(s).kind.is_token for _, s in a.slots)):
            return a
        generated = self.generated(session.instance) + len(walk or ())
        if generated >= budget:
            raise TokenBudgetExhausted(
                f"token budget exhausted: {generated} tokens generated, the budget is {budget} (refused by the replica)"
            )
        if a.chained and a.steps > budget - generated:
            return dataclasses.replace(a, steps=budget - generated)
        return a

    def spent(self, session: Session) -> bool:
        """Whether the session's instance may generate no more (what a step run ahead would waste)."""
        budget = session.grants.token_budget
        return budget is not None and self.generated(session.instance) >= budget

    def generated(self, instance: str) -> int:
        spent = self._spent.get(instance)
        return 0 if spent is None else spent.tokens

    def count(self, session: Session, reply: PassReply) -> None:
        """Add the tokens a pass answered with (counted as the SDK counts them) to its instance's."""
        if session.grants.token_budget is None:
            return
        n = len(reply.walk) or sum(1 for tag, _ in reply.slots if tag in ("t", "tl"))
        if not n:
            return
        spent = self._spent.get(session.instance)
        if spent is None:
            spent = self._spent[session.instance] = _Spent(0, session.expires)
            if len(self._spent) > self._prune_at:
                self._prune()
        spent.tokens += n

    def _prune(self) -> None:
        now = time.time()
        self._spent = {i: s for i, s in self._spent.items() if s.expires > now}
        self._prune_at = max(PRUNE_AT, 2 * len(self._spent))
