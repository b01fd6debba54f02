"""What one instance may put through its channel (``[limits]``, ``ChannelLimits``), checked as each event is emitted.

Every event is checked for its kind and type first: the host's code relays only what it validated (a sandboxed
worker's messages are checked on receipt, ``sandbox/protocol.py``), so a wrong one here is the caller's bug and raises
at once, never inside the flush that other instances' events share. Past a size, an event is dropped, cut or turned
into the instance's end, as ``Limited`` says, so that no instance can make its host hold or copy without bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from pie_cluster.limits import ChannelLimits

VALUE_TYPES: dict[str, type] = {
    "stdout": str,
    "stderr": str,
    "message": str,
    "file": bytes,
    "return": str,
    "error": str,
}
KINDS = tuple(VALUE_TYPES)
TERMINAL = ("return", "error")
STREAMS = ("stdout", "stderr")


def check_event(kind: object, value: object) -> None:
    """Raise ``TypeError`` unless ``kind`` is an event kind and ``value`` its type."""
    expected = VALUE_TYPES.get(kind) if isinstance(kind, str) else None
    if expected is None:
        raise TypeError(f"unknown event kind {kind!r:.40}")
    if type(value) is not expected:
        raise TypeError(f"a {kind} event's value must be {expected.__name__}, not {type(value).__name__}")


def size_of(value: str | bytes) -> int:
    """Bytes of a value as it travels (UTF-8 for text)."""
    if isinstance(value, bytes) or value.isascii():
        return len(value)
    return len(value.encode("utf-8", "surrogatepass"))


def cut(text: str, limit: int) -> str:
    """``text`` in at most about ``limit`` bytes, saying it was cut."""
    kept = text.encode("utf-8", "surrogatepass")[:limit].decode("utf-8", "ignore")
    return f"{kept} … (cut: over [limits] event_bytes = {limit})"


@dataclass
class OutputQuota:
    """One instance's stdout and stderr together: a token bucket (``stdout_bytes_per_s``, ``stdout_burst_bytes``)
    and a lifetime total of bytes written, kept or dropped (``stdout_total_bytes``)."""

    tokens: float
    refilled_at: float
    written: int = 0
    dropped: int = 0  # since the last marker

    def admit(self, size: int, now: float, limits: ChannelLimits) -> bool:
        """Whether a write of ``size`` bytes goes out (else it is dropped, and counted for the marker)."""
        self.written += size
        elapsed, self.refilled_at = now - self.refilled_at, now
        self.tokens = min(limits.stdout_burst_bytes, self.tokens + elapsed * limits.stdout_bytes_per_s)
        if size <= self.tokens:
            self.tokens -= size
            return True
        self.dropped += size
        return False

    def marker(self, limits: ChannelLimits) -> str:
        """The line that says how much was dropped since the last one ("" if nothing was)."""
        if not self.dropped:
            return ""
        line = (
            f"[pie: {self.dropped} bytes of output dropped: over [limits] stdout_bytes_per_s = "
            f"{limits.stdout_bytes_per_s} (bursts of stdout_burst_bytes = {limits.stdout_burst_bytes})]\n"
        )
        self.dropped = 0
        return line


@dataclass(frozen=True)
class Limited:
    """What becomes of an event under its instance's limits: ``value`` goes out as ``kind`` (None: dropped); an
    ``ending`` ends the instance with that error (it went over a limit that output cannot just be dropped for)."""

    kind: str | None
    value: str | bytes = ""
    size: int = 0
    ending: str | None = None


def limit(kind: str, value: str | bytes, quota: OutputQuota, now: float, limits: ChannelLimits) -> Limited:
    """Apply the instance's limits to one checked event (see ``ChannelLimits``)."""
    size = size_of(value)
    if kind in STREAMS:
        if quota.written + size > limits.stdout_total_bytes:
            quota.written += size
            over = f"its output went over [limits] stdout_total_bytes = {limits.stdout_total_bytes}"
            return Limited(None, ending=over)
        if not quota.admit(size, now, limits):
            return Limited(None)
        marker = quota.marker(limits)
        return Limited(kind, marker + value, size + len(marker)) if marker else Limited(kind, value, size)
    if kind in ("message", "file") and size > limits.event_bytes:
        over = f"it sent a {kind} of {size} bytes, over [limits] event_bytes = {limits.event_bytes}"
        return Limited(None, ending=over)
    if kind == "return" and size > limits.return_bytes:
        error = f"its return value has {size} bytes, over [limits] return_bytes = {limits.return_bytes}"
        return Limited("error", error, size_of(error))
    if kind == "error" and size > limits.event_bytes:
        value = cut(value, limits.event_bytes)
        return Limited(kind, value, size_of(value))
    return Limited(kind, value, size)
