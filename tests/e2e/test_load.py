"""1,000 concurrent inferlets of one user on one node (so in one sandboxed worker): each generates a few tokens,
does a bus round trip, parks until released, and returns. All complete; the test prints memory per parked instance and
launch latency percentiles (the numbers in the README's failure-model section come from
`pytest -s tests/e2e/test_load.py`)."""

from __future__ import annotations

import json
import statistics
import textwrap
import time

import psutil
import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.hosts.driver_events import poll
from pie_cluster.launch_request import LaunchRequest

N = 1000

WORKER = textwrap.dedent("""
    import os
    from inferlet import Context, Model, Sampler, messaging, session

    async def main(input):
        gate = messaging.subscribe("gate")
        with Context(Model.load("default")) as ctx:
            ctx.user(input["prompt"])
            tokens = await ctx.generate(Sampler.argmax(), max_tokens=3).collect_tokens()
        messaging.push(f"echo-{input['i']}", str(len(tokens)))
        echoed = await messaging.pull(f"echo-{input['i']}")
        session.send(str(os.getuid()))  # its worker's own uid: one per worker process
        await gate.next()
        gate.unsubscribe()
        return {"i": input["i"], "echoed": echoed}
""")

RELEASE = textwrap.dedent("""
    from inferlet import messaging

    async def main(input):
        messaging.broadcast("gate", "go")
        return "released"
""")


@pytest.fixture(scope="module")
def launcher(ray_session):
    model = ModelConfigEntry(pages=1024, cpus_per_rank=1, max_batch_tokens=2048, max_batch_requests=512)
    controller = start_controller(PieConfig(auth=AuthConfig(enabled=False), model=[model]), detached=False)
    yield ray.get_actor("pie-launcher")
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def worker_process(uid: int) -> psutil.Process:
    """The user's sandboxed worker: the Python process running as that worker's uid under one of this cluster's
    inferlet hosts (not one of a pool that an earlier test ran in the test process itself, nor another test
    session's: worker uids are per pool slot)."""
    from ray.util.state import list_actors

    hosts = {a["pid"] for a in list_actors(filters=[("class_name", "=", "InferletHost"), ("state", "=", "ALIVE")])}
    (found,) = [
        p
        for p in psutil.process_iter(["uids", "cmdline"])
        if p.info["uids"].real == uid
        and "pie_cluster.hosts.sandbox.worker_main" in (p.info["cmdline"] or [])
        and any(parent.pid in hosts for parent in p.parents())
    ]
    return found


def first_event(launcher, instance: str, kind: str, timeout: float = 300) -> list:
    since, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = poll(launcher, "load", instance, since, 10.0)
        for event in got.events:
            if event[1] in (kind, "error", "return"):
                return event
        since = got.next_index
    raise TimeoutError(f"no {kind} event from {instance}")


@pytest.mark.slow
def test_a_thousand_concurrent_pooled_inferlets_all_complete(launcher):
    upload = launcher.upload.remote
    worker = ray.get(upload("load", "worker.py", WORKER.encode())).program
    release = ray.get(upload("load", "release.py", RELEASE.encode())).program
    warm = ray.get(launcher.launch.remote("load", LaunchRequest(program=worker, input={"i": -1, "prompt": "w"})))
    worker_uid = int(first_event(launcher, warm, "message")[2])
    shared = worker_process(worker_uid)
    ray.get(launcher.launch.remote("load", LaunchRequest(program=release)))
    assert json.loads(first_event(launcher, warm, "return")[2])["echoed"] == "3"
    before = shared.memory_info().rss

    async def launch_all() -> list[tuple[str, float]]:
        import asyncio

        async def one(i: int) -> tuple[str, float]:
            started = time.perf_counter()
            request = LaunchRequest(program=worker, input={"i": i, "prompt": f"agent {i} says"})
            instance = await launcher.launch.remote("load", request)
            return instance, time.perf_counter() - started

        return await asyncio.gather(*(one(i) for i in range(N)))

    import asyncio

    launched = asyncio.run(launch_all())
    ids = [instance for instance, _ in launched]
    parked = [first_event(launcher, i, "message") for i in ids]
    assert all(e[1] == "message" and int(e[2]) == worker_uid for e in parked), [e for e in parked if e[1] != "message"]
    parked_rss = shared.memory_info().rss
    assert ray.get(launcher.stats.remote()).running == N

    ray.get(launcher.launch.remote("load", LaunchRequest(program=release)))
    results = [json.loads(first_event(launcher, i, "return")[2]) for i in ids]
    assert sorted(r["i"] for r in results) == list(range(N)) and {r["echoed"] for r in results} == {"3"}
    for _ in range(100):
        if ray.get(launcher.stats.remote()).running == 0:
            break
        time.sleep(0.1)
    assert ray.get(launcher.stats.remote()).running == 0

    latencies = sorted(seconds for _, seconds in launched)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"\n{N} pooled inferlets: {(parked_rss - before) / N / 1024:.0f} KiB per parked instance "
        "(RSS of the user's worker), "
        f"launch latency p50 {statistics.median(latencies) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms"
    )
