"""Per-inferlet stdout/stderr in a process shared by many inferlets.

``sys.stdout`` is process-wide, so a host installs a router once: writes made while an inferlet's context variable
is set (inside its task and every task it spawns) go to that inferlet's sink; all other writes go to the real
stream.
"""

from __future__ import annotations

import contextvars
import io
import sys
from collections.abc import Callable

Sink = Callable[[str, str], None]  # (stream name, text)

_sink: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("inferlet_stdio_sink", default=None)


class _Router(io.TextIOBase):
    def __init__(self, name: str, fallback):
        self._name, self._fallback = name, fallback

    def write(self, text: str) -> int:
        sink = _sink.get()
        if sink is None:
            return self._fallback.write(text)
        if text:
            sink(self._name, text)
        return len(text)

    def flush(self) -> None:
        if _sink.get() is None:
            self._fallback.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fallback.fileno()


def install_router() -> None:
    """Route sys.stdout/sys.stderr through the per-inferlet sinks (idempotent)."""
    if not isinstance(sys.stdout, _Router):
        sys.stdout = _Router("stdout", sys.stdout)
    if not isinstance(sys.stderr, _Router):
        sys.stderr = _Router("stderr", sys.stderr)


def capture(sink: Sink) -> contextvars.Token:
    """From here on (in this context), prints go to ``sink``; reset with ``release``."""
    install_router()
    return _sink.set(sink)


def release(token: contextvars.Token) -> None:
    _sink.reset(token)
