"""Admission control: how many instances run and wait, per user and cluster-wide.

A launch runs at once while its user and the cluster are under their running limits; past them it waits in a
FIFO queue (an ingress replica's ask for a slot of its lease waits in the same one: ``launcher/leases.py``), and
past the queue's limits it is refused with ``Overloaded`` (HTTP 429 with ``Retry-After``), so a
flood of launches costs the cluster a bounded amount of memory instead of growing it without end. When an instance
ends, the first waiting launch whose user is under the per-user limit starts.
"""

from __future__ import annotations

from collections import Counter, deque

from pie_cluster.limits import AdmissionLimits
from pie_cluster.overloaded import Overloaded


class Admission:
    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self._running: Counter[str] = Counter()
        self._queued: Counter[str] = Counter()
        self._queue: deque[tuple[str, str]] = deque()  # (user, instance id or slot ask), oldest first

    @property
    def running(self) -> int:
        return self._running.total()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def admit(self, user: str, instance_id: str) -> bool:
        """True: run it now (counted as running). False: it waits (queued). Raises Overloaded when it can't."""
        limits = self.limits
        if self.running < limits.running and self._running[user] < limits.running_per_user:
            self._running[user] += 1
            return True
        if self._queued[user] >= limits.queued_per_user:
            raise Overloaded(f"user {user!r} already has {self._queued[user]} launches waiting (the limit)")
        if len(self._queue) >= limits.queued:
            raise Overloaded(f"the cluster already has {len(self._queue)} launches waiting (the limit)")
        self._queue.append((user, instance_id))
        self._queued[user] += 1
        return False

    def resume(self, user: str) -> None:
        """Count an instance that was running before the launcher restarted, whatever the limits say now."""
        self._running[user] += 1

    def withdraw(self, user: str, instance_id: str) -> bool:
        """Take a waiting launch out of the queue (it was aborted); False if it was not waiting."""
        try:
            self._queue.remove((user, instance_id))
        except ValueError:
            return False
        self._queued[user] -= 1
        return True

    def ended(self, user: str) -> list[str]:
        """A running instance of ``user`` ended: the waiting launches that start now (counted as running)."""
        self._running[user] -= 1
        starting = []
        for entry in list(self._queue):
            if self.running >= self.limits.running:
                break
            waiting_user, instance_id = entry
            if self._running[waiting_user] < self.limits.running_per_user:
                self._queue.remove(entry)
                self._queued[waiting_user] -= 1
                self._running[waiting_user] += 1
                starting.append(instance_id)
        return starting
