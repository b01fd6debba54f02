"""An instance's event log: long polls wake on new events, and a poll never reports "done" without the terminal
event (a client following the stream would end with nothing)."""

from __future__ import annotations

import asyncio

from pie_cluster.hosts.events import EventLog


def kinds(events) -> list[str]:
    return [e.kind for e in events]


def test_a_long_poll_wakes_on_the_next_event_and_times_out_empty():
    async def scenario():
        log = EventLog()
        empty = await log.wait(0, 0.01)
        asyncio.get_running_loop().call_later(0.01, log.append, "stdout", "hi")
        woke = await log.wait(0, 5.0)
        return empty, woke

    empty, woke = asyncio.run(scenario())
    assert empty == [] and kinds(woke) == ["stdout"]


def test_a_zero_timeout_poll_that_races_the_terminal_event_returns_it():
    async def scenario():
        log = EventLog()
        # Runs while the poll's timed-out wait is being cancelled, after it last looked at the log.
        asyncio.get_running_loop().call_soon(log.append, "return", "ok")
        return await log.wait(0, 0.0), log.done

    got, done = asyncio.run(scenario())
    assert done and kinds(got) == ["return"]


def test_the_terminal_event_is_kept_when_the_buffer_rotates():
    log = EventLog(capacity=2)
    for i in range(5):
        log.append("stdout", str(i))
    log.append("error", "boom")
    log.append("stdout", "after the end")  # ignored: nothing follows a terminal event
    assert kinds(log.since(0)) == ["stdout", "error"] and log.since(0)[0].value == "4"
