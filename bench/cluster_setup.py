"""The two-node Pie cluster that bench/cluster.py measures, brought up on this machine and torn down after.

Two raylets with 4 CPUs each, a Pie cluster on them (one replica of the embedded tiny model, the bus, a pooled
inferlet host per node, the launcher) and the HTTP endpoint on Ray Serve without auth. The sandbox is off: the
inferlets run in the hosts themselves, whose processes and memory the measurements observe (under bubblewrap each
user's inferlets would run in a worker of their own, in a pid namespace of its own).
``with two_node_pie(console) as pie:`` gives the launcher actor, the node ids, an HTTP client and a scratch folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
from local_pie import wait_healthy
from pie_cluster.client import PieClient
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SandboxConfig
from pie_cluster.control.controller import LAUNCHER
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.ingress.app import serve_http, stop_http
from pie_cluster.ray_session import NAMESPACE, job_env
from rich.console import Console
from vllm_peer import free_port


@dataclass
class BenchCluster:
    launcher: object  # the launcher actor
    nodes: list[str]  # Ray node ids, the head first
    client: PieClient  # the HTTP endpoint
    tmp: Path  # a scratch folder, removed with the cluster


@contextlib.contextmanager
def two_node_pie(console: Console) -> Iterator[BenchCluster]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    from ray.cluster_utils import Cluster

    began = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    cluster.add_node(num_cpus=4)
    ray.init(
        address=cluster.address,
        namespace=NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env=job_env(),
    )
    controller = client = None
    tmp = tempfile.TemporaryDirectory(prefix="pie-bench-cluster-")
    try:
        config = PieConfig(
            auth=AuthConfig(enabled=False),
            model=[ModelConfigEntry(pages=256, cpus_per_rank=1)],
            sandbox=SandboxConfig(mode="off"),
        )
        controller = start_controller(config, detached=False)
        url = serve_http(config.auth, NAMESPACE, config.server.model_copy(update={"port": free_port()}))
        wait_healthy(url)
        nodes = ray.get(controller.nodes.remote())
        client = PieClient(url)
        console.log(f"cluster up: {len(nodes)} nodes, HTTP at {url} ({time.perf_counter() - began:.0f} s)")
        yield BenchCluster(ray.get_actor(LAUNCHER), nodes, client, Path(tmp.name))
    finally:
        if client is not None:
            client.close()
        if controller is not None:
            try:
                stop_http()
            except Exception as e:  # a failed run should still tear the cluster down
                console.log(f"stopping Serve failed: {e}")
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
        ray.shutdown()
        cluster.shutdown()
        tmp.cleanup()
