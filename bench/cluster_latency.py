"""(b) of bench/cluster.py: launch latency, from just before the launch until the instance's first event.

For ``async def main(input): return "ok"``, N sequential launches, pooled (an asyncio task in the node's host) vs
isolated (a dedicated host process per instance); the program is uploaded once, before timing. Over HTTP in one
request (POST /v1/instances?stream=true answers with the SSE stream) and in two (POST, then GET .../events).
Interleaved with each, the same launch through the launcher actor directly (a Ray call, then a long-poll for the
first event): the difference is what HTTP and Serve add.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray
from cluster_inferlets import DEADLINE_S, isolated_manifest, run_to_end
from pie_cluster.client import PieClient
from pie_cluster.hosts.driver_events import poll
from pie_cluster.ingress.app import LOCAL_USER
from pie_cluster.launch_request import LaunchRequest

TRIVIAL = 'async def main(input):\n    return "ok"\n'


def http_launch_ms(client: PieClient, program: str) -> float:
    """HTTP POST /v1/instances -> first SSE event, in ms; follows the stream to its end (the instance is done)."""
    start = time.perf_counter()
    instance_id = client.launch(LaunchRequest(program=program))
    first, last = None, None
    for _, kind, value in client.events(instance_id):
        if first is None:
            first = time.perf_counter()
        last = (kind, value)
    if last != ("return", "ok"):
        raise RuntimeError(f"trivial instance {instance_id} ended with {last}")
    return (first - start) * 1e3


def streamed_launch_ms(client: PieClient, program: str) -> float:
    """HTTP POST /v1/instances?stream=true -> the first event after ``launched``, in ms; follows it to the end."""
    start = time.perf_counter()
    first, last = None, None
    for _, kind, value in client.launch_and_follow(LaunchRequest(program=program)):
        if first is None and kind != "launched":
            first = time.perf_counter()
        last = (kind, value)
    if last != ("return", "ok"):
        raise RuntimeError(f"a trivial instance ended with {last}")
    return (first - start) * 1e3


def direct_launch_ms(launcher, program: str) -> float:
    """launcher.launch (a Ray call) -> first event from launcher.events (a long poll), in ms. As the user the HTTP
    endpoint acts for without auth, who owns the program uploaded over HTTP."""
    start = time.perf_counter()
    instance_id = ray.get(launcher.launch.remote(LOCAL_USER, LaunchRequest(program=program, deadline_s=DEADLINE_S)))
    while not (got := poll(launcher, LOCAL_USER, instance_id, 0, 30.0)).events:
        pass
    first = time.perf_counter()
    if run_to_end(launcher, LOCAL_USER, instance_id) != ("return", "ok"):
        raise RuntimeError(f"trivial instance {instance_id} ended with {got}")
    return (first - start) * 1e3


def launch_latency(client: PieClient, launcher, tmp: Path, n: tuple[int, int], warmup: int) -> dict[str, list[float]]:
    """Timings in ms by kind: ``pooled``/``isolated`` (one request), ``-2req`` (two), ``-direct`` (launcher)."""
    pooled_file = tmp / "trivial.py"
    pooled_file.write_text(TRIVIAL)
    isolated_dir = tmp / "trivial-isolated"
    isolated_dir.mkdir()
    (isolated_dir / "main.py").write_text(TRIVIAL)
    (isolated_dir / "pie.toml").write_text(isolated_manifest("trivial-isolated"))
    pooled = client.upload(pooled_file)["program"]
    uploaded = client.upload(isolated_dir)
    assert uploaded["isolated"], uploaded
    isolated = uploaded["program"]
    out: dict[str, list[float]] = {}
    for name, program, count in (("pooled", pooled, n[0]), ("isolated", isolated, n[1])):
        for _ in range(warmup):
            streamed_launch_ms(client, program)
            http_launch_ms(client, program)
            direct_launch_ms(launcher, program)
        streamed, http, direct = [], [], []
        for _ in range(count):
            streamed.append(streamed_launch_ms(client, program))
            http.append(http_launch_ms(client, program))
            direct.append(direct_launch_ms(launcher, program))
        out[name], out[f"{name}-2req"], out[f"{name}-direct"] = streamed, http, direct
    return out
