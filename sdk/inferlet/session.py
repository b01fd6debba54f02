"""``session``: the inferlet's conversation with the client that launched it.

``send`` and ``send_file`` become ``message`` and ``file`` events on the instance's stream (buffered for a client
that attaches later); ``receive`` and ``receive_file`` wait for what the client sends to this instance.
"""

from __future__ import annotations

import json
from typing import Any

from inferlet.runtime import SessionIO, current


def _io() -> SessionIO:
    io = current().io
    if io is None:
        raise RuntimeError("this inferlet has no client session (run it with `pie submit` or the HTTP endpoint)")
    return io


def send(message: Any) -> None:
    """Send a message event to the client: strings verbatim, anything else JSON-encoded."""
    _io().send(message if isinstance(message, str) else json.dumps(message))


def send_file(data: bytes) -> None:
    """Send a binary blob to the client (a ``file`` event)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"send_file needs bytes, got {type(data).__name__}")
    _io().send_file(bytes(data))


async def receive() -> str:
    """Wait for the next message the client sends to this instance."""
    return await _io().receive()


async def receive_file() -> bytes:
    """Wait for the next file the client sends to this instance."""
    return await _io().receive_file()
