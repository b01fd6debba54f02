"""A shard's journal (``pie_cluster.bus.journal``) read back by a new ``Topics``: the queues a restarted shard starts
with are those the old one had, whatever pushes, pulls and give-backs made them, also after the file was rewritten
and when the last record was cut off by the kill; and so are the peers' last applied operation numbers."""

from __future__ import annotations

from collections import OrderedDict

from pie_cluster.bus import journal as journal_module
from pie_cluster.bus.journal import Journal, Replayed
from pie_cluster.bus.topics import Topics


def topics_on(path) -> tuple[Topics, Journal, list]:
    sent: list = []
    journal = Journal(path)
    return Topics(lambda peer, user, event: sent.append(event), journal, journal.replay().queues), journal, sent


def state_of(topics: Topics, applied: OrderedDict | None = None):
    return lambda: Replayed(topics.queued_messages(), applied if applied is not None else OrderedDict())


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
    journal.flush(state_of(topics))
    assert [e[3] for e in sent] == ["job 0", "job 0", "bob's"]

    again, _, _ = topics_on(path)
    assert {k: list(v) for k, v in again.queued_messages().items()} == {("alice", "jobs"): ["job 1", "job 2", "job 3"]}


def churn(path) -> Topics:
    """50 pushes and 25 pulls, one burst each; each push numbered as alice/1's operation ``i + 1``."""
    topics, journal, _ = topics_on(path)
    applied = OrderedDict()
    for i in range(50):
        topics.push(("alice", "t"), str(i))
        applied[b"alice/1"] = i + 1
        journal.applied(b"alice/1", i + 1)
        if i % 2:
            topics.pull(b"alice/1", "alice", i, ("alice", "t"))
        journal.flush(state_of(topics, applied))
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
    replayed = Journal(path).replay()
    assert list(replayed.queues[("alice", "t")]) == kept
    assert replayed.applied == {b"alice/1": 50}


def test_the_last_applied_number_of_each_peer_is_read_back_and_a_peer_that_left_is_not(tmp_path):
    path = tmp_path / "shard.journal"
    journal = Journal(path)
    journal.replay()
    for peer, seq in [(b"a/1", 1), (b"b/1", 1), (b"a/1", 7), (b"c/1", 2), (b"b/1", None)]:
        journal.applied(peer, seq)
    journal.flush(lambda: Replayed())
    assert list(Journal(path).replay().applied.items()) == [(b"a/1", 7), (b"c/1", 2)]  # least recently applied first
