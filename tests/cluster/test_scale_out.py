"""Scale-out: with several ingress replicas and a host per node, the work really is spread over them.

The parts that scale horizontally are the ingress replicas (``[server] ingress_replicas``: each runs the OpenAI
requests it receives) and the node hosts (one per node: the launcher places an uploaded program on the least busy
node that serves the models). A cluster where every request still landed on one replica, or every launch on one
node, would serve no more than a cluster of one, so this module checks where the work went, never how fast it went
(bench/control_plane.py and docs/scaling.md measure that).

Which ingress replica served a request is read from the replicas' own ``/metrics``: each replica keeps a registry of
its own, so its ``pie_request_seconds_count`` counts only the requests it served, and its ``pie_launches_created``
(the time its counter was created, when the replica started) tells the replicas apart. Serve's proxy sends each
scrape to some replica; scraping until every replica has answered gives every replica's count.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import textwrap

import httpx
import pytest
from pie_procs import PIE, free_port

INGRESS_REPLICAS = 2
CHATS = 48
TOKEN = {"Authorization": "Bearer tok-alice"}
WAIT = b"from inferlet import session\n\nasync def main(input):\n    return await session.receive()\n"


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    """Two ingress replicas, a model replica on each of the two nodes (so both nodes' hosts are where launches go),
    auth with the usual test tokens."""
    home = tmp_path_factory.mktemp("pie-scale-out")
    config = home / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        [server]
        port = {free_port()}
        ingress_replicas = {INGRESS_REPLICAS}
        [auth]
        tokens = {{ "tok-alice" = "alice" }}
        [[model]]
        pages = 128
        cpus_per_rank = 1
        max_batch_tokens = 512
        replicas = 2
        placement = "strict_spread"
        """)
    )
    config.chmod(0o600)
    env = {**os.environ, "PIE_HOME": str(home), "RAY_ADDRESS": ray_cluster.address}
    # Serve's Python proxy: its HAProxy ingress fails to start on this test cluster (two raylets on one machine),
    # and which proxy spreads the requests is not what this module checks
    env["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    started = subprocess.run(
        [*PIE, "start", "--config", str(config), "--address", ray_cluster.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr
    yield json.loads((home / "cluster.json").read_text())["url"]
    stopped = subprocess.run([*PIE, "stop", "--address", ray_cluster.address], env=env, capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr


def served_per_replica(url: str, scrapes: int = 80) -> dict[str, float]:
    """Each ingress replica (by the creation time of its counters) and the chat requests it has served."""
    counts: dict[str, float] = {}
    for _ in range(scrapes):
        text = httpx.get(f"{url}/metrics", timeout=30).text
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        replica = lines["pie_launches_created"]
        counts[replica] = sum(
            float(value)
            for name, value in lines.items()
            if name.startswith("pie_request_seconds_count{") and 'route="chat"' in name
        )
        if len(counts) == INGRESS_REPLICAS:
            break
    return counts


async def chat_concurrently(url: str, n: int) -> list[httpx.Response]:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=url, headers=TOKEN, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)))


def test_openai_requests_are_served_by_every_ingress_replica(pie):
    answers = asyncio.run(chat_concurrently(pie, CHATS))
    assert [a.status_code for a in answers] == [200] * CHATS, [a.text for a in answers if a.status_code != 200]
    counts = served_per_replica(pie)
    assert len(counts) == INGRESS_REPLICAS, counts  # every replica answered a scrape
    assert sum(counts.values()) == CHATS, counts  # each request counted once, by the replica that served it
    assert all(n > 0 for n in counts.values()), counts  # and none of them idle


def test_uploaded_programs_are_placed_on_every_nodes_host(pie, ray_session):
    nodes = {n["NodeID"] for n in ray_session.nodes() if n["Alive"]}
    with httpx.Client(base_url=pie, headers=TOKEN, timeout=60) as client:
        uploaded = client.post("/v1/programs", params={"filename": "wait.py"}, content=WAIT)
        program = uploaded.json()["program"]
        # each waits for a message, so it is still running when the next is placed: least busy alternates
        ids = [client.post("/v1/instances", json={"program": program}).json()["id"] for _ in range(8)]
        listed = {i["id"]: i for i in client.get("/v1/instances").json()}
        placed = [listed[i]["node"] for i in ids]
        for instance in ids:
            client.delete(f"/v1/instances/{instance}")
    assert set(placed) == nodes, placed
    assert max(placed.count(n) for n in nodes) - min(placed.count(n) for n in nodes) <= 1, placed
