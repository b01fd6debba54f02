"""The launcher's book of instances: every one it knows, by id — waiting, running, and the last ``keep_finished``
that ended, which stay listed and attachable — and whose each one is."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from pie_cluster.hosts.events import NotFound
from pie_cluster.launcher.records import InstanceRecord


class Instances:
    def __init__(self, keep_finished: int):
        self._by_id: dict[str, InstanceRecord] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # ended ones' ids, oldest first
        self._keep_finished = keep_finished

    def add(self, instance: InstanceRecord) -> InstanceRecord:
        """Book ``instance`` (one that had already ended, as a restarted launcher learns it, as ended)."""
        self._by_id[instance.id] = instance
        if instance.ending is not None:
            self.listed_after_end(instance)
        return instance

    def get(self, instance_id: str) -> InstanceRecord | None:
        return self._by_id.get(instance_id)

    def __getitem__(self, instance_id: str) -> InstanceRecord:
        return self._by_id[instance_id]

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._by_id

    def __iter__(self) -> Iterator[InstanceRecord]:
        return iter(list(self._by_id.values()))

    def own(self, user: str, instance_id: str) -> InstanceRecord:
        """``user``'s instance; another user's is reported as not existing, the same answer as a wrong id."""
        instance = self._by_id.get(instance_id)
        if instance is None or instance.user != user:
            raise NotFound(f"no instance {instance_id!r}")
        return instance

    def running(self, where: Callable[[InstanceRecord], bool] = lambda _: True) -> list[InstanceRecord]:
        """Those not ended (waiting or running) for which ``where`` holds."""
        return [i for i in self._by_id.values() if i.ending is None and where(i)]

    def listed_after_end(self, instance: InstanceRecord) -> None:
        """An ended instance stays listed until ``keep_finished`` newer ones have ended."""
        self._finished[instance.id] = None
        while len(self._finished) > self._keep_finished:
            old, _ = self._finished.popitem(last=False)
            self._by_id.pop(old, None)
