"""Snapshots give their memory back when it is short, where the cluster's directory keeps their lineage: a stored
conversation between turns (a Responses API response, an inferlet's ``save``) holds no pages that a running
inferlet needs. The replica lets go of the least recently used snapshot's pages first; its name stays in the
directory and its next open recomputes it, with the same greedy tokens as before."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
from inferlet import Context, Model, Sampler

PAGES = 24  # of 16 tokens
SAVED = 2  # snapshots of 160 tokens (10 pages each): together they hold all but 4 pages


def text(seed: int, n: int) -> list[int]:
    """Tokens no other text shares a page with, so prefix caching cannot pack two into one pool."""
    return [100 + (i * 7 + seed * 13) % 50 for i in range(n)]


@pytest.fixture(scope="module")
def mirrored(ray_session, tiny_llama):
    """A replica with few pages whose snapshots the cluster's user directory also keeps."""
    from pie_cluster.directory import get_or_create_directory
    from pie_cluster.host import endpoints_for
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings
    from sdk_host import TRUST, Served

    directory = get_or_create_directory(f"pie-test-snapshots-{uuid.uuid4().hex[:8]}")
    settings = RunnerSettings(num_pages=PAGES)
    replica = Replica(
        tiny_llama, 1, settings, cpus_per_rank=1, engine=BatchLimits(), secret=TRUST.secret,
        directory=(directory, "default"),
    )  # fmt: skip
    yield Served(replica, endpoints_for("default", replica))
    replica.shutdown()
    ray.kill(directory)


async def save_conversations(input):
    model = Model.load("default")
    for i in range(SAVED):
        with Context(model) as ctx:
            ctx.append(text(i, 160))
            await ctx.flush()
            ctx.save(f"conversation-{i}")


async def continue_conversation(input):
    with Context.open(Model.load("default"), input["name"]) as ctx:
        return await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()


async def read_long(input):
    """19 pages: more than the snapshots leave free (kept, they would make it wait for ever)."""
    async with asyncio.timeout(120):
        with Context(Model.load("default")) as ctx:
            ctx.append(text(7, 300))
            return await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()


def snapshots_held(served) -> int:
    return ray.get(served.replica.leader.engine_stats.remote())["snapshots"]


def test_idle_snapshots_yield_their_pages_and_reopen_the_same(mirrored):
    mirrored.run(save_conversations)
    assert snapshots_held(mirrored) == SAVED
    before = [mirrored.run(continue_conversation, {"name": f"conversation-{i}"}) for i in range(SAVED)]

    assert len(mirrored.run(read_long)) == 4
    assert snapshots_held(mirrored) < SAVED  # let go of here, still named in the directory

    after = [mirrored.run(continue_conversation, {"name": f"conversation-{i}"}) for i in range(SAVED)]
    assert after == before
