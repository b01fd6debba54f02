"""One context's turn-taking: its passes, forks, truncations and snapshots run one at a time.

An ``asyncio.Lock`` can only be taken by awaiting it, so every operation would need a task of its own. A ``Gate``
can also be taken synchronously, and a waiter can be a plain callback run inside the ``give`` that hands the gate
over; so the engine starts a forward pass straight from the channel's read callback or from the end of its
predecessor's batch, with no task and no wake-ups. Waiters are served first come, first served, and nobody jumps
the line: the gate stays held from the moment it is handed to a waiter until that waiter gives it back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Gate:
    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: deque[asyncio.Future | Callable[[], None]] = deque()

    def locked(self) -> bool:
        return self._held

    def waiting(self) -> bool:
        """Whether someone waits for the gate (maybe one who gave up: ``give`` skips those)."""
        return bool(self._waiters)

    def take_now(self) -> bool:
        """Take the gate if it is free; False if someone holds it (or it was handed to a waiter)."""
        if self._held:
            return False
        self._held = True
        return True

    def when_free(self, start: Callable[[], None]) -> None:
        """Call ``start`` once the gate is the caller's: at once if it is free, else synchronously inside the
        ``give`` that hands it over. ``start`` holds the gate from then on and must give it back."""
        if self.take_now():
            start()
        else:
            self._waiters.append(start)

    async def take(self) -> None:
        if self.take_now():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed over just as it was cancelled: pass it on
                self.give()
            elif turn in self._waiters:  # (give() drops cancelled turns it meets on its own)
                self._waiters.remove(turn)
            raise

    def give(self) -> None:
        """Hand the gate to the first waiter still waiting, else free it."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not isinstance(turn, asyncio.Future):
                turn()
                return
            if not turn.done():
                turn.set_result(None)
                return
        self._held = False

    async def __aenter__(self) -> None:
        await self.take()

    async def __aexit__(self, *exc) -> None:
        self.give()
