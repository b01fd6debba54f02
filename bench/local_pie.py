"""A Pie cluster on this machine for the benchmarks that measure it from the outside (over HTTP, as users do): one
local Ray node, one replica of the embedded tiny model (or the model directory given), the HTTP endpoint without
auth. ``with local_pie(...) as pie:`` gives its base URL and the launcher actor, and tears everything down after."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray
from pie_cluster.config import AuthConfig, CacheConfig, ModelConfigEntry, PieConfig, ResponsesConfig, SandboxConfig
from pie_cluster.control.controller import LAUNCHER
from pie_cluster.control.lifecycle import find_controller, start_controller
from pie_cluster.control.status_records import ReplicaStatus
from pie_cluster.ingress.app import serve_http, stop_http
from pie_cluster.ray_session import NAMESPACE, job_env
from vllm_peer import free_port


@dataclass
class LocalPie:
    url: str  # e.g. http://127.0.0.1:PORT; the OpenAI routes are under /v1
    launcher: object  # the launcher actor, for launching and following inferlets without HTTP

    def replica(self) -> ReplicaStatus:
        """``pie status``'s row of the model's one replica: what it resolved (CPUs per rank, threads, backend)."""
        (replica,) = ray.get(find_controller().status.remote()).replicas
        return replica


@contextlib.contextmanager
def local_pie(
    pages: int = 4096,
    cpus_per_rank: int | None = None,
    max_batch_tokens: int = 2048,
    sandbox: str = "bubblewrap",
    model_dir: Path | None = None,
    replicas: int = 1,
    routing: str = "prefix",
    backend: str = "auto",
    responses: ResponsesConfig | None = None,
    tokens: dict[str, str] | None = None,
    share: str = "user",
) -> Iterator[LocalPie]:
    """``sandbox``: how uploaded programs run (``off``: in the trusted host, the baseline the sandbox is measured
    against); ``cpus_per_rank`` None: the automatic share, as a config that leaves it unset; ``backend``: the
    model's kernels (``[[model]] backend``); ``model_dir``: a Hugging Face directory to serve (None: the embedded
    tiny model); ``replicas`` of it, over which the ingress spreads OpenAI requests by ``routing``;
    ``responses``: the Responses API's settings (None: the defaults); ``tokens``: bearer token -> user, with auth
    on (None: auth off, every caller is ``local``); ``share``: whose prefixes the replicas' caches share
    (``[cache] share``)."""
    ray.init(  # address="local": a Ray of its own, even where another one runs on this machine
        address="local",
        num_cpus=4,
        namespace=NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env=job_env(),  # Serve's HAProxy ingress, as `pie start` runs it
    )
    controller = None
    try:
        entry = ModelConfigEntry(
            pages=pages,
            cpus_per_rank=cpus_per_rank,
            max_batch_tokens=max_batch_tokens,
            replicas=replicas,
            backend=backend,
            path=str(model_dir) if model_dir is not None else None,
        )
        config = PieConfig(
            auth=AuthConfig(enabled=tokens is not None, tokens=tokens or {}),
            cache=CacheConfig(share=share),
            model=[entry],
            sandbox=SandboxConfig(mode=sandbox),
            responses=responses or ResponsesConfig(),
        )
        controller = start_controller(config, detached=False)
        server = config.server.model_copy(update={"port": free_port(), "routing": routing})
        url = serve_http(config.auth, NAMESPACE, server, config.responses, config.cache)
        wait_healthy(url)
        yield LocalPie(url, ray.get_actor(LAUNCHER))
    finally:
        if controller is not None:
            stop_http()
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
        ray.shutdown()


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # Serve's proxy comes up a moment after the app is deployed
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the HTTP endpoint at {url} did not come up within {timeout:g} s")
