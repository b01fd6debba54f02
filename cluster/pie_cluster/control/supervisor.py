"""Replacing model replicas that die or hang, each replica watched by a thread of its own.

Every rank of every tensor-parallel group is probed with a deadline. A rank that is dead (its process killed, its
node lost) or that misses ``[supervision] misses`` probes in a row (hung: stopped, deadlocked) gets its whole group
replaced, since the other ranks cannot go on without it. One thread per replica means that a replacement that
waits (a bundle Ray cannot place yet, a model that loads for minutes) never delays probing or replacing another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray
import ray.exceptions
from pie_workers.replica import Replica

from pie_cluster.config import SupervisionConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """One probe of a tensor-parallel group: each rank's pid (None where it gave none), and which ranks are dead and
    which did not answer within the deadline."""

    pids: tuple[int | None, ...]
    dead: tuple[int, ...]
    silent: tuple[int, ...]

    @property
    def state(self) -> str:
        """As ``pie status`` shows the replica (before the supervisor has acted on it)."""
        return "dead" if self.dead else "unresponsive" if self.silent else "serving"


def probe_ranks(ranks: list, deadline_s: float) -> Probe:
    """Ask every rank at once to answer within ``deadline_s``."""
    refs = [rank.ping.remote() for rank in ranks]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline_s)
    answered = set(ready)
    pids, dead, silent = [], [], []
    for i, ref in enumerate(refs):
        if ref not in answered:
            pids.append(None)
            silent.append(i)
            continue
        try:
            pids.append(ray.get(ref))
        except ray.exceptions.RayError:
            pids.append(None)
            dead.append(i)
    return Probe(tuple(pids), tuple(dead), tuple(silent))


class Supervisor:
    """Watches ``replicas`` (model name -> its replicas, replaced in place), making replacements with ``make(name,
    index)`` and announcing each, one at a time, with ``publish()``."""

    def __init__(
        self,
        settings: SupervisionConfig,
        replicas: dict[str, list[Replica]],
        make: Callable[[str, int], Replica],
        publish: Callable[[], None],
    ):
        self.settings = settings
        self.replicas = replicas
        self.restarting: set[tuple[str, int]] = set()  # (model, index) of replicas being replaced
        self.restarts = 0
        self._make, self._publish = make, publish
        self._publishing = threading.Lock()
        self._stopping = threading.Event()
        self._watchers: dict[tuple[str, int], object] = {}  # the one thread that watches each replica
        for name, group in replicas.items():
            for index in range(len(group)):
                self.watch(name, index)

    def watch(self, name: str, index: int) -> None:
        """Watch replica ``index`` of ``name`` until it is no longer there (the autoscaler removed it), or another
        thread watches it (it was removed and added again before this one noticed)."""
        self._watchers[(name, index)] = token = object()
        threading.Thread(
            target=self._watch, args=(name, index, token), name=f"supervise-{name}-{index}", daemon=True
        ).start()

    def stop(self) -> None:
        self._stopping.set()

    def _watch(self, name: str, index: int, token: object) -> None:
        settings, misses = self.settings, 0
        while not self._stopping.wait(settings.probe_every_s):
            if index >= len(self.replicas[name]) or self._watchers.get((name, index)) is not token:
                return  # removed (control.scaling), or watched by a newer thread
            replica = self.replicas[name][index]
            probe = probe_ranks(replica.ranks, settings.probe_deadline_s)
            misses = misses + 1 if probe.silent and not probe.dead else 0
            if self._stopping.is_set() or not probe.dead and misses < settings.misses:
                continue
            if probe.dead:
                why = f"rank {probe.dead[0]} died"
            else:
                why = f"rank {probe.silent[0]} missed {misses} probes of {settings.probe_deadline_s} s (hung)"
            try:
                self._replace(name, index, replica, why)
                misses = 0
            except Exception:  # e.g. its bundle cannot be placed yet: tried again on the next probe
                log.exception("replacing replica %d of model %r failed", index, name)

    def _replace(self, name: str, index: int, old: Replica, why: str) -> None:
        log.warning("replica %d of model %r: %s; replacing its tensor-parallel group", index, name, why)
        self.restarting.add((name, index))
        for rank in old.ranks:  # the survivors of a tensor-parallel group cannot go on without the lost one
            ray.kill(rank)
        fresh = self._make(name, index)
        with self._publishing:
            if index >= len(self.replicas[name]):  # removed meanwhile (control.scaling): not wanted any more
                fresh.shutdown()
                self.restarting.discard((name, index))
                return
            self.replicas[name][index] = fresh
            self.restarts += 1
            self.restarting.discard((name, index))
            self._publish()
