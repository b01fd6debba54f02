"""The bounds each part of the cluster enforces, as the records it is handed: ``config.toml``'s ``[launcher]`` and
``[limits]`` tables (``config.py``) resolve to these, so the launcher, the hosts and the bus shards take plain values
and never read the config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionLimits:
    """How many instances run and wait in the launcher's queue, per user and cluster-wide (``[launcher]``)."""

    running: int = 4096
    running_per_user: int = 1024
    queued: int = 4096
    queued_per_user: int = 1024


@dataclass(frozen=True)
class BusLimits:
    """What one bus shard bounds (see ``LimitsConfig`` for each): a message, a user's queued messages, its journal."""

    message_bytes: int = 16 << 20
    queued_bytes_per_user: int = 64 << 20
    journal_bytes: int = 2 << 30


@dataclass(frozen=True)
class ChannelLimits:
    """How many events an instance's channel buffers, and how many ended instances' channels a host keeps; what
    one instance may put through its channel (see ``LimitsConfig`` for each bound)."""

    event_buffer: int = 4096
    keep_finished: int = 1024
    stdout_bytes_per_s: int = 1 << 20
    stdout_burst_bytes: int = 4 << 20
    stdout_total_bytes: int = 64 << 20
    event_bytes: int = 1 << 20
    return_bytes: int = 4 << 20
    event_log_bytes: int = 8 << 20
    inbox_bytes: int = 64 << 20
    inbox_bytes_per_user: int = 256 << 20
