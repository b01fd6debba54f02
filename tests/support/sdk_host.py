"""Test helper: run inferlet coroutines against a served replica exactly as `pie run` does."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
from pie_cluster.hosts.in_process import LocalTrust
from pie_cluster.hosts.run import endpoints_for, run_inferlet
from pie_workers.engine.engine_stats import EngineStats
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.replica import Replica
from pie_workers.runner import RunnerSettings

TRUST = LocalTrust(b"the test session's cluster secret")
"""The test session's trusted side: its replicas and buses verify with ``TRUST.secret``, and each inferlet a test
runs gets ``**TRUST.instance(user)`` (fixed, so Ray tasks of the session mint alike)."""


def one_cpu_replica(model_dir) -> Replica:
    """A one-rank torch replica of ``model_dir`` on one CPU, for the tests that kill or drain replicas of their own."""
    settings = RunnerSettings(num_pages=512, backend="torch")
    return Replica(model_dir, 1, settings, cpus_per_rank=1, engine=BatchLimits(), secret=TRUST.secret)


def failing_over(first: Replica, then: Replica) -> dict:
    """Endpoints of ``first`` (the tiny model served as "default") that name ``then`` to fail over to."""
    (endpoint,) = endpoints_for("default", first).values()
    (after,) = endpoints_for("default", then).values()
    return {"default": dataclasses.replace(endpoint, failover=(after.address,))}


class Served:
    def __init__(self, replica, endpoints):
        self.replica, self.endpoints = replica, endpoints

    def run(self, main, input: dict | None = None, user: str = "alice"):
        return asyncio.run(run_inferlet(main, input or {}, self.endpoints, user, **TRUST.instance(user)))

    def run_many(self, mains_inputs, user: str = "alice"):
        async def all_of():
            return await asyncio.gather(
                *(run_inferlet(m, i, self.endpoints, user, **TRUST.instance(user)) for m, i in mains_inputs),
                return_exceptions=True,
            )

        return asyncio.run(all_of())

    def stats(self) -> EngineStats:
        return ray.get(self.replica.leader.engine_stats.remote())


def each_backend():
    """A ``served`` fixture for a test module that runs every test on both backends: ``served = each_backend()``."""

    @pytest.fixture(scope="module", params=["torch", "vllm"])
    def served(request):
        return request.getfixturevalue(f"served_{request.param}")

    return served
