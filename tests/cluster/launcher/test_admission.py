"""Admission limits as a state machine (the launcher's own object, exercised directly), then over HTTP."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pie_cluster.launcher.admission import Admission
from pie_cluster.limits import AdmissionLimits
from pie_cluster.overloaded import Overloaded


def test_runs_then_queues_then_refuses_and_starts_waiters_in_order():
    a = Admission(AdmissionLimits(running=3, running_per_user=2, queued=3, queued_per_user=2))
    assert a.admit("alice", "a1") and a.admit("alice", "a2")
    assert not a.admit("alice", "a3")  # alice is at her running limit: she waits
    assert a.admit("bob", "b1")  # bob is not held up behind her
    assert not a.admit("bob", "b2")  # the cluster is full (3 running)
    assert not a.admit("alice", "a4")
    with pytest.raises(Overloaded, match="user 'alice' already has 2 launches waiting"):
        a.admit("alice", "a5")
    with pytest.raises(Overloaded, match="the cluster already has 3 launches waiting"):
        a.admit("carol", "c1")
    assert a.ended("bob") == ["b2"]  # a3 waited longer, but alice is still at her own limit
    assert a.ended("alice") == ["a3"]  # then the oldest of hers
    assert (a.running, a.queued) == (3, 1)


def test_a_withdrawn_launch_leaves_the_queue():
    a = Admission(AdmissionLimits(running=1, running_per_user=1, queued=2, queued_per_user=2))
    assert a.admit("u", "1") and not a.admit("u", "2") and not a.admit("u", "3")
    assert a.withdraw("u", "2") and not a.withdraw("u", "2")
    assert a.ended("u") == ["3"] and (a.running, a.queued) == (1, 0)


def test_overloaded_crosses_process_boundaries_with_its_retry_hint():
    error = pickle.loads(pickle.dumps(Overloaded("full", 2.5)))
    assert str(error) == "full" and error.retry_after_s == 2.5


@given(st.lists(st.tuples(st.sampled_from(["launch", "end", "abort"]), st.sampled_from("abc")), max_size=60))
def test_limits_always_hold_and_nothing_is_lost(ops):
    """Against a plain model: whatever the sequence, running and queued stay within every limit, each launch is
    exactly one of running / waiting / refused / ended, and a slot is never left idle while someone could use it."""
    limits = AdmissionLimits(running=3, running_per_user=2, queued=4, queued_per_user=2)
    a = Admission(limits)
    running: dict[str, list[str]] = {u: [] for u in "abc"}
    waiting: list[tuple[str, str]] = []
    for n, (op, user) in enumerate(ops):
        if op == "launch":
            try:
                (running[user].append(str(n)) if a.admit(user, str(n)) else waiting.append((user, str(n))))
            except Overloaded:
                assert len(waiting) >= limits.queued or sum(u == user for u, _ in waiting) >= limits.queued_per_user
        elif op == "end" and running[user]:
            running[user].pop(0)
            for started in a.ended(user):
                owner = next(u for u, i in waiting if i == started)
                waiting.remove((owner, started))
                running[owner].append(started)
        elif op == "abort" and any(u == user for u, _ in waiting):
            entry = next(e for e in waiting if e[0] == user)
            assert a.withdraw(*entry)
            waiting.remove(entry)
        total = sum(map(len, running.values()))
        assert (a.running, a.queued) == (total, len(waiting))
        assert total <= limits.running and all(len(r) <= limits.running_per_user for r in running.values())
        if total < limits.running:  # room overall: whoever waits is held by their own per-user limit
            assert all(len(running[u]) >= limits.running_per_user for u, _ in waiting)
