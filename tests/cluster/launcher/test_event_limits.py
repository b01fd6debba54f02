"""What one instance may put through the channels of the host that runs it, and that one cannot cost another.

Alice's instance floods, forges and oversizes its events; bob's, on the same ``Channels`` (one host), keeps every
event and his ending in the same loop turns. Each limit that ends an instance names itself.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from pie_cluster.config import PieConfig
from pie_cluster.hosts.events import Channels, Ending
from pie_cluster.limits import ChannelLimits

SMALL = ChannelLimits(
    stdout_bytes_per_s=1000,
    stdout_burst_bytes=4000,
    stdout_total_bytes=100_000,
    event_bytes=1000,
    return_bytes=2000,
    event_log_bytes=10_000,
)


class Host:
    """Channels as a host holds them: endings reported, over-limit instances aborted (they end with the reason)."""

    def __init__(self, limits: ChannelLimits = SMALL, can_abort: bool = True):
        self.endings: list[Ending] = []
        self.aborted: dict[str, str] = {}
        self.channels = Channels(limits, self.endings.extend, self.abort if can_abort else lambda *_: False)

    def abort(self, instance_id: str, reason: str) -> bool:
        self.aborted[instance_id] = reason
        return True

    def events(self, instance_id: str) -> list[tuple[str, object]]:
        channel = self.channels.find(instance_id)
        return [(e.kind, e.value) for e in channel.log.since(0)]


def run(scenario) -> None:
    asyncio.run(scenario())


async def turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def test_a_forged_kind_raises_at_the_emit_and_costs_no_other_instance_its_events():
    """Before, an unknown kind was queued and then raised in the shared flush: bob's ending was lost with it."""

    async def scenario():
        host = Host()
        for who in ("alice", "bob"):
            host.channels.open(who, who)
        host.channels.emit("bob", "message", "hello")
        for kind, value in [("pwned", "x"), ("message", b"bytes"), ("file", "text"), ("return", 3)]:
            with pytest.raises(TypeError):
                host.channels.emit("alice", kind, value)
        host.channels.emit("bob", "return", "ok")
        await turn()
        assert host.events("bob") == [("message", "hello"), ("return", "ok")]
        assert host.endings == [Ending("bob", "return", "ok")]

    run(scenario)


def test_a_print_flood_is_merged_in_linear_time_rate_limited_and_ended_past_its_total():
    async def scenario():
        host = Host()
        for who in ("alice", "bob"):
            host.channels.open(who, who)
        line = "x" * 99 + "\n"
        for _ in range(200):  # 20 kB in one turn: the burst (4 kB) goes out, as one event; the rest is dropped
            host.channels.emit("alice", "stdout", line)
        host.channels.emit("bob", "stdout", "bob's line\n")
        await turn()
        [(kind, kept)] = host.events("alice")
        assert kind == "stdout" and len(kept) == 4000
        await asyncio.sleep(0.2)  # ~200 bytes of rate refill
        host.channels.emit("alice", "stdout", line)
        await turn()
        marker = host.events("alice")[-1][1]
        assert "16000 bytes of output dropped" in marker and "stdout_bytes_per_s = 1000" in marker, marker
        for _ in range(1000):  # past the total of 100 kB (written, dropped or not)
            host.channels.emit("alice", "stdout", line)
        assert "[limits] stdout_total_bytes = 100000" in host.aborted["alice"]
        host.channels.emit("alice", "stdout", "after the limit: dropped")
        host.channels.emit("alice", "error", host.aborted["alice"])  # as its aborted program ends
        host.channels.emit("bob", "return", "ok")
        await turn()
        assert host.events("bob") == [("stdout", "bob's line\n"), ("return", "ok")]
        assert host.events("alice")[-1] == ("error", host.aborted["alice"])
        assert "after the limit" not in str(host.events("alice"))

    run(scenario)


def test_oversized_values_end_or_are_cut_naming_their_limit():
    async def scenario():
        host = Host(can_abort=False)  # the channel ends what its host cannot abort
        for who in ("message", "file", "return", "error"):
            host.channels.open(who, "alice")
        host.channels.emit("message", "message", "m" * 1001)
        host.channels.emit("file", "file", b"f" * 1001)
        host.channels.emit("return", "return", "r" * 2001)
        host.channels.emit("error", "error", "e" * 5000)
        await turn()
        assert host.events("message") == [
            ("error", "the instance was ended: it sent a message of 1001 bytes, over [limits] event_bytes = 1000")
        ]
        assert "a file of 1001 bytes, over [limits] event_bytes = 1000" in host.events("file")[0][1]
        returned = "its return value has 2001 bytes, over [limits] return_bytes = 2000"
        assert host.events("return") == [("error", returned)]
        [(kind, cut)] = host.events("error")
        assert kind == "error" and cut.startswith("e" * 1000) and "event_bytes = 1000" in cut and len(cut) < 1100

    run(scenario)


def test_the_event_log_keeps_its_newest_bytes_and_always_its_ending():
    async def scenario():
        host = Host(dataclasses.replace(SMALL, stdout_burst_bytes=100_000))
        host.channels.open("a", "alice")
        for i in range(40):
            host.channels.emit("a", "message", f"{i:03d}" + "m" * 997)
            await turn()
        host.channels.emit("a", "return", "r" * 2000)
        await turn()
        events = host.events("a")
        assert sum(len(v) for _, v in events) <= 10_000
        assert events[-1] == ("return", "r" * 2000) and events[0][1].startswith("032")

    run(scenario)


def test_the_defaults_reach_the_hosts_channels():
    config = PieConfig.model_validate({"limits": {"event_bytes": 5, "stdout_total_bytes": 7}})
    limits = config.launcher.channel_limits(config.limits)
    assert (limits.event_bytes, limits.stdout_total_bytes, limits.return_bytes) == (5, 7, 4 << 20)


def test_an_instance_ended_for_a_limit_ends_with_that_error_however_its_program_ends():
    async def scenario():
        host = Host()
        host.channels.open("a", "alice")
        host.channels.emit("a", "message", "m" * 1001)  # its host aborts it ...
        host.channels.emit("a", "message", "dropped: it is being ended")
        host.channels.emit("a", "return", "ok")  # ... but it returned first
        await turn()
        assert host.events("a") == [("error", host.aborted["a"])] and "event_bytes = 1000" in host.aborted["a"]

    run(scenario)
