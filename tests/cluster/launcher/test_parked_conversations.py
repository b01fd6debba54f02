"""The ingress's table of parked Responses conversations, on real channels and a real event loop: each entry is
taken once and only by its user with the same header, an idle one is told to save after ``park_s`` (and reported
saved once it ended), the oldest is told to save past ``max_parked``, and a deleted one to end without saving."""

from __future__ import annotations

import asyncio

from inferlet.responses_schema import DISCARD, SAVE
from pie_cluster.hosts.events import Channel, EventLog
from pie_cluster.ingress.responses.parked import ParkedConversations, ParkedTurn


def _parked(response_id: str, user: str = "alice", header: str = "h") -> ParkedTurn:
    return ParkedTurn(response_id, user, "default", header, f"instance-{response_id}", Channel(user, EventLog()), 0)


def _told(parked: ParkedTurn) -> list[str]:
    queue = parked.channel.inbox.queues["message"]
    return [queue.get_nowait() for _ in range(queue.qsize())]


def test_an_entry_is_taken_once_by_its_user_with_its_header():
    async def run() -> None:
        table = ParkedConversations(park_s=60, max_parked=8, saved=lambda parked: None)
        turn = _parked("r1")
        table.park(turn)
        assert table.take("r1", "bob", "h") is None and table.take("r1", "alice", "other") is None
        assert table.take("r1", "alice", "h") is turn and table.take("r1", "alice", "h") is None
        assert len(table) == 0 and _told(turn) == []
        ended = _parked("r2")
        table.park(ended)
        ended.channel.log.append("return", "null")  # aborted while parked
        assert table.take("r2", "alice", "h") is None

    asyncio.run(run())


def test_an_idle_entry_saves_and_the_oldest_saves_past_the_limit():
    async def run() -> None:
        saved: list[str] = []
        table = ParkedConversations(park_s=0.2, max_parked=2, saved=lambda parked: saved.append(parked.response_id))
        first, second, third = _parked("r1"), _parked("r2"), _parked("r3")
        for turn in (first, second, third):
            table.park(turn)
        assert saved == ["r1"] and _told(first) == [SAVE] and len(table) == 2
        await asyncio.sleep(0.4)
        assert sorted(saved) == ["r1", "r2", "r3"] and _told(second) == [SAVE] and _told(third) == [SAVE]
        assert len(table) == 0

    asyncio.run(run())


def test_a_deleted_entry_ends_without_saving_and_only_for_its_user():
    async def run() -> None:
        saved: list[str] = []
        table = ParkedConversations(park_s=0.2, max_parked=8, saved=lambda parked: saved.append(parked.response_id))
        turn = _parked("r1")
        table.park(turn)
        table.discard("r1", "bob")
        assert len(table) == 1 and _told(turn) == []
        table.discard("r1", "alice")
        assert len(table) == 0 and _told(turn) == [DISCARD]
        await asyncio.sleep(0.4)  # its expiry was cancelled with it
        assert saved == [] and _told(turn) == []

    asyncio.run(run())
