"""A shard's journal (``pie_cluster.bus.journal``) read back by a new ``Topics``: the queues a restarted shard starts
with are those the old one had, whatever pushes, pulls and give-backs made them, also after the file was rewritten
and when the last record was cut off by the kill."""

from __future__ import annotations

from pie_cluster.bus import journal as journal_module
from pie_cluster.bus.journal import Journal
from pie_cluster.bus.topics import Topics


def topics_on(path) -> tuple[Topics, Journal, list]:
    sent: list = []
    journal = Journal(path)
    return Topics(lambda peer, user, event: sent.append(event), journal), journal, sent


def test_a_new_shard_starts_with_the_queues_the_old_one_left(tmp_path):
    path = tmp_path / "shard.journal"
    topics, journal, sent = topics_on(path)
    for i in range(4):
        topics.push(("alice", "jobs"), f"job {i}")
    topics.push(("bob", "jobs"), "bob's")
    topics.pull(b"alice/1", "alice", 1, ("alice", "jobs"))  # job 0 pulled...
    topics.requeue(("alice", "jobs"), ["job 0"])  # ...and given back
    topics.pull(b"alice/1", "alice", 2, ("alice", "jobs"))
    topics.pull(b"bob/1", "bob", 3, ("bob", "jobs"))
    topics.pull(b"bob/1", "bob", 4, ("bob", "jobs"))  # waits: nothing of a waiter is journaled
    journal.flush(topics.queued_messages)
    assert [e[3] for e in sent] == ["job 0", "job 0", "bob's"]

    again, _, _ = topics_on(path)
    assert {k: list(v) for k, v in again.queued_messages().items()} == {("alice", "jobs"): ["job 1", "job 2", "job 3"]}


def churn(path) -> Topics:
    """50 pushes and 25 pulls, one burst each."""
    topics, journal, _ = topics_on(path)
    for i in range(50):
        topics.push(("alice", "t"), str(i))
        if i % 2:
            topics.pull(b"alice/1", "alice", i, ("alice", "t"))
        journal.flush(topics.queued_messages)
    return topics


def test_the_file_is_rewritten_past_its_bound_and_a_cut_off_record_is_ignored(tmp_path, monkeypatch):
    whole = tmp_path / "whole.journal"
    churn(whole)
    monkeypatch.setattr(journal_module, "COMPACT_AT", 10)
    path = tmp_path / "shard.journal"
    topics = churn(path)
    kept = [str(i) for i in range(25, 50)]
    assert list(topics.queued_messages()[("alice", "t")]) == kept
    assert path.stat().st_size < whole.stat().st_size * 0.75  # rewritten from the queue, not 75 records
    with path.open("ab") as f:
        f.write(b"\x94\xa1+")  # the start of a record, cut off by the kill
    again, _, _ = topics_on(path)
    assert list(again.queued_messages()[("alice", "t")]) == kept
