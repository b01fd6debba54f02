"""Fixtures of the cluster tests: a two-node Pie cluster (controller, a replica on each node, launcher) for the
modules that drive one, the message bus the bus tests share, and a fresh user per test."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import ray
from pie_cluster.bus import start_bus
from pie_cluster.config import AuthConfig, LauncherConfig, ModelConfigEntry, PieConfig
from pie_cluster.control.lifecycle import start_controller
from support.bus_calls import BUS
from support.pie_procs import own_node
from support.sdk_host import TRUST


@pytest.fixture(scope="module")
def bus(ray_session):
    """A bus of two shards, for one test module."""
    bus = start_bus(2, name=BUS, detached=False, secret=TRUST.secret)
    yield bus
    bus.shutdown()


@pytest.fixture
def user() -> str:
    """A fresh user per test, so tests sharing the bus never share a topic."""
    return f"user-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def store_parent(tmp_path_factory) -> Path:
    """Where the cluster's launcher makes its program store (``[launcher] program_store_dir``)."""
    return tmp_path_factory.mktemp("program-stores")


@pytest.fixture(scope="module")
def cluster(request, ray_session, store_parent):
    """A controller with one replica of the tiny model on each node, sandboxed (the default), for one module (whose
    ``LAUNCHER_LIMITS``, if it has them, are the launcher's admission settings)."""
    model = ModelConfigEntry(pages=256, cpus_per_rank=1, max_batch_tokens=512, replicas=2, placement="strict_spread")
    limits = getattr(request.module, "LAUNCHER_LIMITS", {})
    launcher = LauncherConfig(program_store_dir=str(store_parent), **limits)
    config = PieConfig(auth=AuthConfig(enabled=False), model=[model], launcher=launcher)  # sandboxed: the default
    controller = start_controller(config, detached=False)
    yield controller
    ray.get(controller.shutdown.remote())
    ray.kill(controller)
    assert not list(store_parent.iterdir()), "the stopped cluster left its program store behind"


@pytest.fixture(scope="module")
def launcher(cluster):
    """The cluster's launcher actor."""
    return ray.get_actor("pie-launcher")


@pytest.fixture
def extra_node(ray_cluster):
    """Adds a node to the session's Ray cluster for one test (``extra_node(num_cpus=..., ...)``, waiting for it to
    join); whatever the test has not removed is removed when it ends, however it ends, so that the session's other
    tests never find it."""
    added = []

    def add(**node_args):
        node = ray_cluster.add_node(**node_args, **own_node())
        ray_cluster.wait_for_nodes()
        added.append(node)
        return node

    yield add
    for node in added:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node)
