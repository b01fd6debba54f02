"""Session fixtures: the tiny models (built once, offline) and one Ray instance for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI must be reproducible); local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    from pie_workers.tiny_model import default_model_path

    return default_model_path("llama")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    from pie_workers.tiny_model import default_model_path

    return default_model_path("qwen3")


@pytest.fixture(scope="module")
def hf(tiny_llama):
    """The tiny Llama in transformers, (tokenizer, model): the reference the SDK and example tests check against."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama), AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="session")
def second_node_cache(tmp_path_factory) -> Path:
    """The second node's ``PIE_CACHE_DIR``: what Pie builds or fetches there lands here, not in the head's cache."""
    return tmp_path_factory.mktemp("second-node-cache")


@pytest.fixture(scope="session")
def ray_cluster(second_node_cache):
    """One Ray cluster of two nodes (two raylets on this machine) for the whole session; starting it costs ~5 s.

    The head has the dashboard (the Jobs API needs it); the second node carries a ``second_node`` resource so a
    test can pin work there, and its own Pie cache directory, so it starts without the head's files as a separate
    machine would. Tests that do not care see one pool of 8 CPUs.
    """
    import ray
    from ray.cluster_utils import Cluster
    from support.pie_procs import RAY_TEMP, free_port, own_node

    # Ray's monitoring that no test reads, slowed or off, for the CPU it costs beside the tests (106 CPU-s in the node
    # agents over a full parallel run, which read every worker's usage each few seconds; each worker's metrics and
    # task-event reports): set before the raylets start, whose processes inherit them; each node's log monitor is
    # off (``own_node``). The state API's actor table, which tests read, is the GCS's own, not these reports.
    os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "600000")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
    # Ray's fixed defaults (dashboard 8265, each node's job agent 52365) would collide between this cluster's two
    # raylets (the second one's job agent then never registers and job submissions wait on it) and with any other
    # test session on the machine
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": True,
            "dashboard_port": free_port(),
            **own_node(),
        },
    )
    second = {"num_cpus": 4, "resources": {"second_node": 1}, **own_node()}
    cluster.add_node(**second, env_vars={"PIE_CACHE_DIR": str(second_node_cache)})
    ray.init(address=cluster.address, log_to_driver=False, namespace="pie-test")
    # as `ray start` does: Ray's job supervisor gives a job's driver the cluster named there (else any GCS running on
    # this machine, which may be another test session's)
    Path(RAY_TEMP, "ray_current_cluster").write_text(cluster.address)
    # what finds "the cluster on this machine" (Ray's state API, `pie` commands without --address) finds this one,
    # not whichever another test session on this machine started last
    os.environ["RAY_ADDRESS"] = cluster.address
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    import ray

    return ray


@pytest.fixture(scope="module")
def market(ray_session):
    """A KV-page market of the module's own, for replicas that report to one."""
    from pie_cluster.market import MarketActor

    actor = MarketActor.remote()
    yield actor
    ray_session.kill(actor)


def _served(tiny_llama, backend: str):
    """One replica of the tiny Llama with its engine running, served under the model name "default"."""
    from pie_cluster.hosts.run import endpoints_for
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings
    from support.sdk_host import TRUST, Served

    settings = RunnerSettings(num_pages=512, backend=backend)
    replica = Replica(tiny_llama, 1, settings, cpus_per_rank=2, engine=BatchLimits(), secret=TRUST.secret)
    yield Served(replica, endpoints_for("default", replica))
    replica.shutdown()


@pytest.fixture(scope="session")
def served_torch(ray_session, tiny_llama):
    """The tiny Llama on the torch backend, for the whole session."""
    yield from _served(tiny_llama, "torch")


@pytest.fixture(scope="session")
def served(served_torch):
    """The replica most tests use (modules that test both backends override it with ``each_backend``)."""
    return served_torch


@pytest.fixture(scope="module")
def served_vllm(ray_session, tiny_llama):
    """The same on the vllm backend, for one module at a time (see ``each_backend``)."""
    yield from _served(tiny_llama, "vllm")
