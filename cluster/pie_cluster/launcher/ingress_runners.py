"""The ingress replicas that run the cluster's own programs themselves, as the launcher sees them.

A runner (one ingress replica) asks the launcher to admit each instance it runs and tells it how each ended; the
launcher has no call into it but the one the runner keeps open for aborts (``waiting_aborts``), and it pings the
runner's actor to learn when it died, so that the instances it ran end with an error and free their slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import ray.exceptions
from pie_workers.deadlines import NoAnswer, answer

from pie_cluster.config import SupervisionConfig

log = logging.getLogger(__name__)


@dataclass
class Runner:
    handle: object  # its Ray actor (the Serve replica), pinged to learn that it died
    aborts: asyncio.Queue = field(default_factory=asyncio.Queue)  # ids of its instances that their users aborted
    watch: asyncio.Task | None = None
    admitted: int = 0  # instances it has run


class Runners:
    def __init__(self, supervision: SupervisionConfig, died: Callable[[str], Awaitable[None]]):
        """``died(runner)``: called once when a runner's actor is gone."""
        self._supervision, self._died = supervision, died
        self._runners: dict[str, Runner] = {}

    def seen(self, name: str, handle) -> None:
        """A runner admitting an instance: watched from its first admission on."""
        if name not in self._runners:
            runner = self._runners[name] = Runner(handle)
            runner.watch = asyncio.get_running_loop().create_task(self._watch(name, runner))
        self._runners[name].admitted += 1

    def admitted(self) -> dict[str, int]:
        """Instances each live runner has run (``pie status``: how the ingress replicas share the requests)."""
        return {name: runner.admitted for name, runner in self._runners.items()}

    def abort(self, name: str, instance_id: str) -> None:
        runner = self._runners.get(name)
        if runner is not None:  # a runner found dead has had its instances ended already
            runner.aborts.put_nowait(instance_id)

    async def waiting_aborts(self, name: str, wait: float) -> list[str]:
        """The ids its users aborted since the last call, waiting up to ``wait`` s for one (a long poll)."""
        runner = self._runners.get(name)
        if runner is None:
            await asyncio.sleep(min(wait, 60.0))  # it has admitted nothing yet
            return []
        with contextlib.suppress(TimeoutError):
            first = await asyncio.wait_for(runner.aborts.get(), min(max(wait, 0.0), 60.0))
            return [first] + [runner.aborts.get_nowait() for _ in range(runner.aborts.qsize())]
        return []

    async def _watch(self, name: str, runner: Runner) -> None:
        """Pinged like the pooled hosts (``[supervision]``); a hung one is left to Serve's health checks."""
        while True:
            await asyncio.sleep(self._supervision.probe_every_s)
            try:
                pinged = runner.handle.__ray_ready__.remote()
                await answer(pinged, "an ingress replica", self._supervision.probe_deadline_s)
            except NoAnswer:
                continue
            except ray.exceptions.RayError:
                log.warning("ingress replica %s died: the instances it ran are lost", name)
                del self._runners[name]
                await self._died(name)
                return
