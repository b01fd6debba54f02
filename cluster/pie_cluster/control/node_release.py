"""Giving back the nodes that autoscaled replicas came for, so Ray's autoscaler (or KubeRay's) can remove them.

Ray removes a node only when it is idle, and a node running any actor is not idle, even one that reserves nothing:
the node's inferlet host (``num_cpus=0``) would keep every node the autoscaler ever added. So a node that held a
replica beyond a model's ``min_replicas`` (an *elastic* node: it came for that replica, from the autoscaler) gives
its host back once it holds no replica of any model: the launcher places no launch there from then on, the
inferlets already there run to their end wherever that is, and then the host is stopped. Should a replica land on
the node again before it is gone (a new scale-up finding it still there), the node takes launches again and keeps
its host. Unlike ``pie drain``, nothing is ended or moved: a released node that stays gets a host again when a
replica comes back to it. The controller's node, and nodes with bus shards, are never released.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray
from pie_workers.deadlines import LAUNCHER_S, answered

if TYPE_CHECKING:
    from pie_cluster.control.controller import Controller

log = logging.getLogger(__name__)
POLL_S = 0.5


class NodeRelease:
    """The controller's elastic nodes, and which of them gave their host back (both kept across its restarts)."""

    def __init__(self, controller: Controller, elastic: set[str], released: set[str]):
        self.controller = controller
        self.elastic = elastic  # nodes that held a replica beyond a model's min_replicas
        self.released = released  # ... whose host was stopped: no host is started there while it holds no replica
        self._releasing: set[str] = set()
        self._here = ray.get_runtime_context().get_node_id()

    def follow(self, alive: set[str]) -> None:
        """One round of the controller's node watch: note elastic nodes, start releasing the idle ones, and let a
        released node that holds a replica again have a host (the node watch then starts one)."""
        controller = self.controller
        occupied = self._occupied()
        for name, group in list(controller.replicas.items()):
            entry = controller.models[name].entry
            if entry.most > entry.fewest:
                self.elastic.update(r.info.node_id for r in group[entry.fewest :])
        self.elastic &= alive
        back = self.released & occupied
        gone = self.released - alive
        if back or gone:
            self.released -= back | gone
            controller.save()
        shards = {info.node_id for info in controller.bus.infos}
        for node in sorted(self.elastic - occupied - shards - self._releasing - {self._here}):
            if node in controller.hosts and len(controller.hosts) > 1:
                self._releasing.add(node)
                threading.Thread(target=self._release, args=(node,), name=f"release-{node[:8]}", daemon=True).start()

    def _occupied(self) -> set[str]:
        return {r.info.node_id for group in list(self.controller.replicas.values()) for r in group}

    def _release(self, node: str) -> None:
        controller, launcher = self.controller, self.controller.launcher
        try:
            running = answered(launcher.drain.remote(node), "the launcher", LAUNCHER_S)  # closed to launches
            while running and node not in self._occupied():
                time.sleep(POLL_S)
                running = answered(launcher.drain.remote(node), "the launcher", LAUNCHER_S)
            with controller.hosting:  # (replicas are published under it: none lands there unseen meanwhile)
                if node in self._occupied():  # a replica came back before the node went: it stays in use
                    answered(launcher.reopen.remote(node), "the launcher", LAUNCHER_S)
                    return
                host = controller.hosts.pop(node)
                self.released.add(node)
                answered(launcher.remove_host.remote(node, f"node {node} was released"), "the launcher", LAUNCHER_S)
                ray.kill(host, no_restart=True)
                controller.save()
            log.info("node %s released: it holds no replica and runs no inferlet", node)
        except Exception:  # e.g. the launcher restarting: the next round tries again
            log.exception("releasing node %s failed", node)
        finally:
            self._releasing.discard(node)
