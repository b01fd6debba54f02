"""Starting (or joining) Ray the way every Pie entry point does: quiet, offline, in the ``pie`` namespace."""

from __future__ import annotations

import os

NAMESPACE = "pie"


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str | None:
    """Join the cluster at ``address`` ("auto": the one running on this machine), or with no address start an
    embedded one of our own (even when another cluster runs here), in the ``pie`` namespace; returns the Ray
    dashboard's address when this call connected and the cluster has one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return None
    kwargs = {"namespace": NAMESPACE, "log_to_driver": False, "include_dashboard": False}
    if address is None:
        address, kwargs["num_cpus"] = "local", num_cpus
    else:
        kwargs.pop("include_dashboard")  # a running cluster already decided that
    return ray.init(address=address, **kwargs).dashboard_url or None
