"""A snapshot's pages on the replica that holds it. They are given back when memory is short, where the cluster's
directory keeps the lineage: a stored conversation between turns (a Responses API response, an inferlet's ``save``)
holds no pages that a running inferlet needs. The replica lets go of the least recently used snapshot's pages first;
its name stays in the directory and its next open recomputes it, with the same greedy tokens as before. And a
context that ends with its save can hand its pages to the snapshot instead of copying them (``save_and_release``).
"""

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
    from pie_cluster.hosts.run import endpoints_for
    from pie_cluster.stores.directory import get_or_create_directory
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings
    from support.sdk_host import TRUST, Served

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
    return ray.get(served.replica.leader.engine_stats.remote()).snapshots


def test_idle_snapshots_yield_their_pages_and_reopen_the_same(mirrored):
    mirrored.run(save_conversations)
    assert snapshots_held(mirrored) == SAVED
    before = [mirrored.run(continue_conversation, {"name": f"conversation-{i}"}) for i in range(SAVED)]

    assert len(mirrored.run(read_long)) == 4
    assert snapshots_held(mirrored) < SAVED  # let go of here, still named in the directory

    after = [mirrored.run(continue_conversation, {"name": f"conversation-{i}"}) for i in range(SAVED)]
    assert after == before


async def save_two_ways(input):
    """The same conversation saved with a copy, and kept by moving its pages; both opened and continued."""
    model = Model.load("default")
    names = {"copied": f"copied-{input['run']}", "moved": f"moved-{input['run']}"}
    for how, name in names.items():
        ctx = Context(model)
        ctx.append(text(9, 40))
        await ctx.flush()
        if how == "copied":
            ctx.save(name)
            ctx.release()
        else:
            ctx.save_and_release(name)
    out = {}
    for how, name in names.items():
        with Context.open(model, name) as ctx:
            out[how] = await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
        Context.delete(model, name)
    return out


def test_a_context_kept_by_moving_its_pages_opens_like_one_saved(mirrored):
    before = ray.get(mirrored.replica.leader.engine_stats.remote())
    continued = mirrored.run(save_two_ways, {"run": uuid.uuid4().hex[:6]})
    assert continued["moved"] == continued["copied"]
    after = ray.get(mirrored.replica.leader.engine_stats.remote())
    assert after.contexts == 0 and after.snapshots == before.snapshots
