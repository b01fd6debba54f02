"""Conversations parked in this ingress: the Responses program instances that served a stored turn and wait, with
their context live, for the conversation's next turn.

A continuation that finds its previous response parked here is sent to that instance (``inferlet.responses``):
no launch, no snapshot opened or saved, only the new input prefilled. Each entry is taken once (a second
continuation of the same response, a fork, renders the history instead), and one left idle for ``park_s`` is told
to save its conversation as the response's snapshot and end, as is the oldest when more than ``max_parked`` wait.
Everything here runs on the ingress's event loop, so an entry is either taken or expired, never both.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from inferlet.responses_schema import DISCARD, SAVE

from pie_cluster.hosts.events import Channel


@dataclass
class ParkedTurn:
    """One parked conversation: the response it last answered, whose it is, its model, what its context begins
    with, and the instance holding it (its channel, and the index of its first event after the parked turn)."""

    response_id: str
    user: str
    model: str
    header: str
    instance: str
    channel: Channel
    since: int
    expiry: asyncio.TimerHandle | None = None


class ParkedConversations:
    def __init__(self, park_s: float, max_parked: int, saved: Callable[[ParkedTurn], None]):
        """``saved``: called once an expired conversation's program was told to save its snapshot."""
        self.park_s, self._max = park_s, max_parked
        self._saved = saved
        self._parked: OrderedDict[str, ParkedTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, parked: ParkedTurn) -> None:
        """Keep ``parked`` until its next turn, ``park_s`` at most."""
        loop = asyncio.get_running_loop()
        parked.expiry = loop.call_later(self.park_s, self._expire, parked.response_id)
        self._parked[parked.response_id] = parked
        while len(self._parked) > self._max:
            self._expire(next(iter(self._parked)))

    def take(self, response_id: str, user: str, header: str) -> ParkedTurn | None:
        """The user's conversation parked after ``response_id``, for its next turn (None: not parked here, ended,
        or begun with another header: then it stays parked)."""
        parked = self._parked.get(response_id)
        if parked is None or parked.user != user or parked.header != header:
            return None
        self._unpark(parked)
        return None if parked.channel.log.done else parked

    def discard(self, response_id: str, user: str) -> None:
        """The user deleted the response: its parked program ends without saving."""
        parked = self._parked.get(response_id)
        if parked is not None and parked.user == user:
            self._unpark(parked)
            self.dismiss(parked.channel)

    def close(self) -> None:
        """Every parked conversation saves its snapshot and ends (the ingress is shutting down)."""
        for response_id in list(self._parked):
            self._expire(response_id)

    def _expire(self, response_id: str) -> None:
        parked = self._parked.get(response_id)
        if parked is not None:
            self._unpark(parked)
            if _tell(parked.channel, SAVE):
                self._saved(parked)

    def _unpark(self, parked: ParkedTurn) -> None:
        del self._parked[parked.response_id]
        if parked.expiry is not None:
            parked.expiry.cancel()

    @staticmethod
    def dismiss(channel: Channel) -> None:
        """A parked program whose turn could not be recorded ends without saving."""
        _tell(channel, DISCARD)


def _tell(channel: Channel, word: str) -> bool:
    try:
        channel.put("message", word)
        return True
    except ValueError:  # it has ended meanwhile (aborted)
        return False
