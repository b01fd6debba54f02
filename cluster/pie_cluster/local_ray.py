"""Starting (or joining) Ray the way every Pie entry point does: quiet, offline, in the ``pie`` namespace."""

from __future__ import annotations

import os

NAMESPACE = "pie"


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str | None:
    """Join ``address`` (or a running local cluster, or start an embedded one) in the ``pie`` namespace; returns
    the Ray dashboard's address when this call connected and the cluster has one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return None
    kwargs = {"namespace": NAMESPACE, "log_to_driver": False, "include_dashboard": False}
    if address is None:
        kwargs["num_cpus"] = num_cpus
    return ray.init(address=address, **kwargs).dashboard_url or None
