"""Ray's real autoscaler on this machine: ``ray.cluster_utils.AutoscalingCluster``, whose fake node provider starts
and stops raylets here as a cloud provider would start and stop machines.

Ray's class is used for its cluster config, with three changes for a machine where other Ray clusters run (the test
suite's, a developer's): its base config is given here (the Ray wheel does not ship the ``example.yaml`` it reads);
the head starts through ``ray.cluster_utils.Cluster`` on a port and directory of its own instead of ``ray start``
after a ``ray stop --force`` that would kill every Ray process on the machine; and ``shutdown`` stops only this
cluster's processes — the head's and the fake nodes the autoscaler started (the autoscaler's children).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import psutil
import ray
from ray._common.network_utils import build_address
from ray._private import ray_constants
from ray._private.services import get_node_ip_address
from ray.cluster_utils import AutoscalingCluster, Cluster

BASE_CONFIG = {
    "cluster_name": "pie-fake-nodes",
    "max_workers": 8,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}
AUTOSCALER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


class LocalAutoscalingCluster(AutoscalingCluster):
    """A head with ``head_cpus`` and worker nodes of ``worker_node_types`` that Ray's autoscaler adds for pending
    work and removes ``idle_timeout_minutes`` after they go idle. ``address`` is set once started."""

    def __init__(self, head_cpus: int, worker_node_types: dict, port: int, temp_dir: str, **config_kwargs):
        self._port, self._temp_dir = port, temp_dir
        self._head_cpus = head_cpus
        self._cluster: Cluster | None = None
        self.address = build_address(get_node_ip_address(), port)
        super().__init__({"CPU": head_cpus}, worker_node_types, **config_kwargs)

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = json.loads(json.dumps(BASE_CONFIG))
        config["provider"]["gcs_address"] = self.address  # the fake nodes join this head, not one on 6379
        config["available_node_types"] = {
            **worker_node_types,
            "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
        }
        config.update(config_kwargs)
        return config

    def start(self, _system_config=None, override_env=None) -> None:
        handle, path = tempfile.mkstemp(prefix="pie-autoscaling-", suffix=".json")
        with os.fdopen(handle, "w") as f:
            json.dump(self._config, f)
        before = {name: os.environ.get(name) for name in AUTOSCALER_ENV}
        os.environ.update(AUTOSCALER_ENV)  # read by the autoscaler the head starts (and its fake nodes)
        try:
            self._cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": self._head_cpus,
                    "gcs_server_port": self._port,
                    "temp_dir": self._temp_dir,
                    "include_dashboard": False,
                    "dashboard_agent_listen_port": 0,  # not Ray's fixed default, which another raylet may hold
                    "autoscaling_config": path,
                },
            )
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def worker_nodes(self) -> int:
        """How many of the autoscaler's nodes are alive (the head not counted)."""
        head = self._cluster.head_node.node_id
        return sum(1 for node in ray.nodes() if node["Alive"] and node["NodeID"] != head)

    def wait_for_workers(self, count: int, timeout_s: float) -> float:
        """Seconds until exactly ``count`` worker nodes are alive; raises after ``timeout_s``."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.worker_nodes() == count:
                return time.monotonic() - began
            time.sleep(0.5)
        raise TimeoutError(f"not {count} worker nodes within {timeout_s} s (now {self.worker_nodes()})")

    def shutdown(self) -> None:
        if self._cluster is None:
            return
        monitor = self._cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
        nodes = [p for info in monitor for p in _descendants(info.process.pid)]  # the fake nodes' processes
        self._cluster.shutdown()
        for process in nodes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(nodes, timeout=10)
        self._cluster = None


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
