"""The inferlet hosts the launcher places instances on: the controller's pool (a pooled host per node and what each
node's inferlets reach), which nodes take no launch now (drained, or their host down), and the watch on each pooled
host.

A dead host fails the call the launcher keeps open on it (``lifetime``). A hung one (stopped, deadlocked) fails
nothing, so it is also pinged as the supervisor pings replica ranks (``[supervision]``); one that misses ``misses``
pings in a row is killed, and Ray restarts it like a host that died. Its instances are the launcher's to end: it is
told through ``on_died``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable

import ray
import ray.exceptions
from pie_workers.deadlines import HOST_S, NoAnswer, answer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.config import SupervisionConfig
from pie_cluster.hosts.node_host import InferletHost, NodeServices
from pie_cluster.launcher.records import HostPool
from pie_cluster.launcher.recovery import LauncherMemory, LauncherState
from pie_cluster.limits import ChannelLimits
from pie_cluster.programs.program import Program

log = logging.getLogger(__name__)


@dataclasses.dataclass
class HostsWiring:
    """What the hosts' book calls back into the launcher with."""

    spawn: Callable[[Awaitable], None]  # keeps a task of the launcher's running
    services_moved: Callable[[], None]  # what inferlets reach changed (the ingress replicas fetch it again)
    died: Callable[[str, object], Awaitable[None]]  # (node, host): a pooled host died, taking its instances


class Hosts:
    """The pool the controller hands over, kept in the launcher's saved state, and the nodes closed to launches."""

    def __init__(
        self, state: LauncherState, memory: LauncherMemory, supervision: SupervisionConfig, wiring: HostsWiring
    ):
        self._state = state
        self._memory = memory
        self._supervision = supervision
        self._wiring = wiring
        self.down: set[str] = set()  # nodes whose pooled host is dead (restarting, or its node is lost)
        self.draining = state.draining  # nodes ``pie drain`` closed to launches

    @property
    def pool(self) -> HostPool | None:
        return self._state.pool

    def required(self) -> HostPool:
        """The pool, for a call that cannot be answered before the controller has handed it over."""
        if self._state.pool is None:
            raise RuntimeError("the launcher has no inferlet hosts yet (is the cluster started?)")
        return self._state.pool

    def attach(self, pool: HostPool) -> None:
        self._changed(pool)
        self.watch_all()

    def watch_all(self) -> None:
        for node, host in self.pool.hosts.items():
            self._wiring.spawn(self._watch(node, host))

    def add(self, node: str, host, services: dict[str, NodeServices]) -> None:
        """A node joined: its pooled host takes launches from now on (``services``: every node's, its own included).
        A released node given a host again (``control.node_release``) is open again."""
        self.draining.discard(node)
        self._changed(dataclasses.replace(self.pool, hosts={**self.pool.hosts, node: host}, services=services))
        self._wiring.services_moved()
        self._wiring.spawn(self._watch(node, host))

    def set_services(self, services: dict[str, NodeServices]) -> None:
        self._changed(dataclasses.replace(self.pool, services=services))
        self._wiring.services_moved()

    def close(self, node: str) -> None:
        """``pie drain``: the node takes no launch from now on (kept across the launcher's restarts)."""
        if node not in self.draining:  # asked again and again while its instances finish
            self.draining.add(node)
            self._memory.save(self._state)

    def reopen(self, node: str) -> None:
        """A node being released holds a replica again (``control.node_release``): it takes launches again."""
        if node in self.draining:
            self.draining.discard(node)
            self._memory.save(self._state)

    def remove(self, node: str) -> None:
        """A drained node's host was stopped: it takes no launch again and has no services to give one."""
        self._changed(self.pool.without(node))
        self._wiring.services_moved()

    def choose_node(self, asked: str | None, load: dict[str, int]) -> str:
        """Where a launch runs (``HostPool.choose_node``): never a drained node or one whose host is down."""
        closed = {n: "it was drained (`pie drain`) or released to the autoscaler" for n in self.draining}
        closed |= {n: "its inferlet host is down (restarting, or its node is lost)" for n in self.down}
        return self.pool.choose_node(asked, closed, load)

    def dedicated(self, node: str, program: Program, channels: ChannelLimits):
        """A host of its own for an isolated program when the sandbox is off (a Ray actor on ``node``)."""
        options = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        if program.runtime_env:
            options["runtime_env"] = program.runtime_env
        launcher = ray.get_runtime_context().current_actor
        host = ray.remote(InferletHost).options(**options)
        return host.remote(launcher, self.pool.services[node], self.pool.secret, None, channels)

    @property
    def market(self):
        """The market's handle (one market: every node's services name it), or None without one."""
        return next(iter(self.pool.services.values())).market

    def _changed(self, pool: HostPool) -> None:
        self._state.pool = pool
        self._memory.save(self._state)

    async def _watch(self, node: str, host) -> None:
        """A pooled host that dies (its process killed, its node lost) or hangs (then it is killed) takes its
        instances with it. Ray restarts it; launches on the node then work again."""
        while node in self.pool.hosts:
            await until_gone(node, host, self._supervision)
            if node not in self.pool.hosts:  # drained: its host was stopped with nothing left on it
                return
            self.down.add(node)
            await self._wiring.died(node, host)
            while True:  # until Ray has restarted it (a lost node's host never comes back)
                try:
                    await asyncio.wait_for(host.ready.remote(), timeout=30)
                    services = host.set_services.remote(self.pool.services[node])  # it restarted with the first ones
                    await answer(services, f"the inferlet host on node {node}", HOST_S)
                    self.down.discard(node)
                    break
                except (ray.exceptions.RayError, TimeoutError):
                    await asyncio.sleep(1.0)


async def until_gone(node: str, host, settings: SupervisionConfig) -> None:
    """Returns once ``host`` has died, or has been killed (for Ray to restart) because it hung."""
    lifetime = asyncio.ensure_future(_lifetime(host))
    misses = 0
    while not lifetime.done():
        await asyncio.wait({lifetime}, timeout=settings.probe_every_s)
        if lifetime.done():
            return
        try:
            await answer(host.ready.remote(), f"the inferlet host on node {node}", settings.probe_deadline_s)
            misses = 0
        except NoAnswer:
            misses += 1
        except ray.exceptions.RayError:  # it died: lifetime fails too
            continue
        if misses >= settings.misses:
            log.warning("the inferlet host on node %s missed %d pings: killing it for Ray to restart", node, misses)
            ray.kill(host, no_restart=False)
            await lifetime
            return


async def _lifetime(host) -> None:
    with contextlib.suppress(ray.exceptions.RayError):
        await host.lifetime.remote()
