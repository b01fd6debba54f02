"""A subscription to a broadcast topic, buffered in the inferlet (``inferlet.messaging``'s overflow rule)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

SUBSCRIPTION_BUFFER = 1024  # unread messages a subscription keeps; the oldest goes first when it overflows


class Subscription:
    """Broadcasts on one topic, buffered in the inferlet: at most ``SUBSCRIPTION_BUFFER`` unread, the oldest dropped
    first and counted in ``dropped``."""

    def __init__(self, topic: str, on_unsubscribe: Callable[[Subscription], None]):
        self.topic = topic
        self.dropped = 0
        self._unread: deque[str] = deque()
        self._ready = asyncio.Event()  # set while there is something to read, or once the subscription is over
        self._open = True
        self._error: Exception | None = None  # why the bus ended it (its shard died), raised once it is read out
        self._on_unsubscribe = on_unsubscribe

    async def next(self) -> str | None:
        """The next broadcast, waiting for it; ``None`` once unsubscribed. Raises the bus's ``BusError`` once the
        messages that arrived before its shard died have been read."""
        while self._open and not self._unread and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._unread and self._open:
            return self._unread.popleft()
        if self._error is not None:
            raise self._error
        return None

    def unsubscribe(self) -> None:
        """Stop receiving; unread messages are discarded and ``next`` returns ``None`` from now on."""
        if self._open:
            self._end()
            self._on_unsubscribe(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> str:
        message = await self.next()
        if message is None:
            raise StopAsyncIteration
        return message

    def _deliver(self, message: str) -> None:
        if len(self._unread) == SUBSCRIPTION_BUFFER:
            self._unread.popleft()
            self.dropped += 1
        self._unread.append(message)
        self._ready.set()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._ready.set()

    def _end(self) -> None:
        self._open = False
        self._unread.clear()
        self._ready.set()
