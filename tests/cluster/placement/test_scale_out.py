"""Scale-out: with several ingress replicas and a host per node, the work really is spread over them.

The parts that scale horizontally are the ingress replicas (``[server] ingress_replicas``: each runs the OpenAI
requests it receives) and the node hosts (one per node: the launcher places an uploaded program on the least busy
node that serves the models). A cluster where every request still landed on one replica, or every launch on one
node, would serve no more than a cluster of one, so this module checks where the work went, never how fast it went
(bench/control_plane.py and docs/scaling.md measure that).

Which ingress replica served a request is read from the launcher, which admits every OpenAI request for the replica
that runs it and counts them per replica (``pie status``: ``launcher.ingress_replicas``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.pie_procs import engine_status, started_pie

INGRESS_REPLICAS = 2
CHATS = 48
TOKEN = {"Authorization": "Bearer tok-alice"}
WAIT = b"from inferlet import session\n\nasync def main(input):\n    return await session.receive()\n"


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    """Two ingress replicas, a model replica on each of the two nodes (so both nodes' hosts are where launches go)."""
    server = f"ingress_replicas = {INGRESS_REPLICAS}"
    model = 'replicas = 2\n        placement = "strict_spread"'
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-scale-out"), server=server, model=model)


async def chat_concurrently(url: str, n: int) -> list[httpx.Response]:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=url, headers=TOKEN, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(n)))


def test_openai_requests_are_served_by_every_ingress_replica(pie):
    """Bursts of concurrent requests until both replicas have served some (Serve may route a first burst to one
    replica while the other is still joining its routing table); the launcher counts what each replica admitted."""
    sent, counts = 0, {}
    while len(counts) < INGRESS_REPLICAS and sent < 5 * CHATS:
        answers = asyncio.run(chat_concurrently(pie["url"], CHATS))
        assert [a.status_code for a in answers] == [200] * CHATS, [a.text for a in answers if a.status_code != 200]
        sent += CHATS
        counts = engine_status(pie)["launcher"]["ingress_replicas"]
    assert len(counts) == INGRESS_REPLICAS and all(n > 0 for n in counts.values()), counts
    assert sum(counts.values()) == sent, counts  # each request admitted once, by the replica serving it


def test_uploaded_programs_are_placed_on_every_nodes_host(pie, ray_session):
    nodes = {n["NodeID"] for n in ray_session.nodes() if n["Alive"]}
    with httpx.Client(base_url=pie["url"], headers=TOKEN, timeout=60) as client:
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
