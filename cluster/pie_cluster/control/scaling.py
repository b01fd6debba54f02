"""Replicas that follow each model's target (``control.autoscaler``): the controller's side of autoscaling.

A thread reads every autoscaled model's replicas' loads each ``[supervision] probe_every_s``, asks the model's
policy for its target, saves it with the controller's state (a restarted controller scales on toward it) and
starts one change per model at a time:

* **adding** a replica makes a placement group of one bundle for it (pending until a node has room: Ray's
  autoscaler, or KubeRay's, adds one for a pending group), starts the replica there, and only then publishes it:
  inferlets and requests reach it from the next launch on;
* **removing** takes the highest-numbered replica out of what is published (no new context lands there), hands its
  contexts and snapshots, KV pages and all, to the model's first replica (``control.handover``: its inferlets go on
  there without recomputing), stops it and removes its bundle, so an idle node can go. If the handover cannot be
  made, its contexts get ``DRAIN_S`` to finish instead, and an inferlet still on it then moves to another replica
  as after any replica's loss (``inferlet._failover``: recomputed from its lineage).

A model's first ``min_replicas`` replicas share its placement group (spread as ``placement`` says) and are never
removed; the others each have their own. Changes only ever add or remove at the end, so a replica's index, its
supervisor thread and its bundle stay tied together.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import ray
import ray.exceptions
from pie_workers.replica import replica_placement
from ray.util.placement_group import remove_placement_group

from pie_cluster.control.autoscaler import ModelScale, ReplicaLoad, ScalePolicy
from pie_cluster.control.handover import hand_over, stats_until, successor, wait_for_notices

if TYPE_CHECKING:
    from pie_cluster.control.controller import Controller

log = logging.getLogger(__name__)
DRAIN_S = 120.0  # how long a replica being removed waits for its contexts to finish


class ReplicaScaler:
    """The controller's autoscaled models (``max_replicas`` over ``min_replicas``), kept at their targets."""

    def __init__(self, controller: Controller, saved: dict[str, ModelScale]):
        self.controller = controller
        self.policies = {
            name: ScalePolicy(model.entry, saved.get(name) or _initial(model.entry, len(controller.replicas[name])))
            for name, model in controller.models.items()
            if model.entry.most > model.entry.fewest
        }
        self._changing: set[str] = set()  # models with an addition or removal under way
        self._lock = threading.Lock()
        if self.policies:
            threading.Thread(target=self._follow, name="replica-scaler", daemon=True).start()

    def targets(self) -> dict[str, ModelScale]:
        """What the controller saves: each autoscaled model's target and its reason."""
        return {name: policy.scale for name, policy in self.policies.items()}

    def scales(self) -> dict[str, ModelScale]:
        """Each autoscaled model's target and reason, with how many replicas it has now."""
        return {
            name: replace(policy.scale, current=len(self.controller.replicas[name]))
            for name, policy in self.policies.items()
        }

    def _follow(self) -> None:
        controller = self.controller
        while not controller.stopping.wait(controller.config.supervision.probe_every_s):
            for name, policy in self.policies.items():
                try:
                    loads = self._loads(name)
                    if not loads:  # none answered: no reading, no decision (an outage is not an idle model)
                        continue
                    before = policy.scale
                    scale = policy.decide(loads, time.monotonic())
                    if scale != before:
                        log.info("model %r: target %d replicas (%s)", name, scale.target, scale.reason)
                        controller.save()
                    self._converge(name, scale.target)
                except Exception:  # e.g. a replica that does not answer: the next round tries again
                    log.exception("scaling model %r failed", name)

    def _loads(self, name: str) -> list[ReplicaLoad]:
        """The serving replicas' loads (one that does not answer within the probe deadline counts as none)."""
        deadline = self.controller.config.supervision.probe_deadline_s
        refs = [replica.leader.engine_stats.remote() for replica in list(self.controller.replicas[name])]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline)
        loads = []
        for ref in ready:
            try:
                stats = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            loads.append(ReplicaLoad(stats.contexts, stats.suspended))
        return loads

    def _converge(self, name: str, target: int) -> None:
        current = len(self.controller.replicas[name])
        with self._lock:
            if name in self._changing or current == target:
                return
            if any(model == name for model, _ in self.controller.supervisor.restarting):
                return  # a replacement under way: the count is not what it seems
            self._changing.add(name)
        change = self._add if current < target else self._remove
        threading.Thread(target=self._change, args=(change, name), name=f"scale-{name}", daemon=True).start()

    def _change(self, change, name: str) -> None:
        try:
            change(name)
        except Exception:
            log.exception("changing model %r's replicas failed", name)
        finally:
            with self._lock:
                self._changing.discard(name)

    def _add(self, name: str) -> None:
        controller = self.controller
        model = controller.models[name]
        entry, index = model.entry, len(controller.replicas[name])
        group = replica_placement(
            1, entry.tensor_parallel, model.cpus_per_rank, model.use_gpu, "PACK", entry.resources,
            detached=controller.detached,
        )  # fmt: skip
        controller.models[name] = replace(model, added=(*model.added, group))
        controller.save()  # a restart in between removes a bundle that has no replica (recovery.trim_placements)
        began = time.monotonic()
        try:
            replica = controller.new_replica(name, index)  # waits for its bundle, then for the model to load
        except BaseException:  # e.g. no node had room within [supervision] start_s: the next round tries again
            remove_placement_group(group)
            controller.models[name] = model
            controller.save()
            raise
        with controller.hosting:
            controller.replicas[name].append(replica)
        controller.supervisor.watch(name, index)
        controller.publish()
        log.info("model %r: replica %d added in %.1f s", name, index, time.monotonic() - began)

    def _remove(self, name: str) -> None:
        controller = self.controller
        with controller.hosting:
            replica = controller.replicas[name].pop()
        controller.publish()  # from here no launch is sent there; the supervisor's thread for it ends
        began = time.monotonic()
        target = successor(controller.replicas[name], replica)
        moved = hand_over(replica, target) if target is not None else None
        if moved is not None:
            wait_for_notices(replica)
        finished = moved is not None or stats_until(replica, lambda stats: stats.contexts == 0, DRAIN_S)
        replica.shutdown()
        model = controller.models[name]
        remove_placement_group(model.added[-1])
        controller.models[name] = replace(model, added=model.added[:-1])
        controller.save()
        log.info(
            "model %r: replica %d removed after %.1f s (%s)", name, len(controller.replicas[name]),
            time.monotonic() - began, moved or ("its contexts had finished" if finished else "contexts left moved on"),
        )  # fmt: skip


def _initial(entry, count: int) -> ModelScale:
    return ModelScale(entry.name, entry.fewest, entry.most, target=count)
