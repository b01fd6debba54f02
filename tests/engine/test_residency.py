"""Memory contention on a replica with few pages: bids decide who stays resident; nobody loses tokens or pages.

Every workload here needs more pages than the replica has (24 pages of 16 tokens), so contexts are suspended while
their inferlets run: their pages wait in the replica's host buffer (24 pages too) when it has room, and are
recomputed when it has not. The reference for each inferlet's tokens is the same inferlet run alone. (The market
tests run a replica without a host buffer: there every suspension is recomputed.)
"""

from __future__ import annotations

import asyncio
import time

import pytest
from inferlet import Context, Model, Sampler

PAGES = 24
MEMORY = [100 + i % 50 for i in range(320)]  # a 320-token text


@pytest.fixture(scope="module", params=["torch", "vllm"])
def scarce(ray_session, tiny_llama, request):
    """A replica with too few pages for what the tests run on it, on each backend (suspension moves whole pages
    in the backend's own layout)."""
    from pie_cluster.hosts.run import endpoints_for
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings
    from support.sdk_host import TRUST, Served

    settings = RunnerSettings(num_pages=PAGES, backend=request.param)
    replica = Replica(tiny_llama, 1, settings, cpus_per_rank=1, engine=BatchLimits(), secret=TRUST.secret)
    yield Served(replica, endpoints_for("default", replica))
    replica.shutdown()


async def chat(input):
    """A greedy reply to the prompt, optionally bidding explicitly, stamped with when it ended."""
    with Context(Model.load("default")) as ctx:
        if "bid" in input:
            ctx.set_bid(input["bid"])
        ctx.user(input["prompt"])
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=input["n"]).collect_tokens()
        return {"tokens": tokens, "ended": time.monotonic()}


def prompts(k: int) -> list[str]:
    return [f"Story {i}: once upon a time a tiny model counted {i} sheep and then" for i in range(k)]


def solo(served, inputs: list[dict]) -> list[list[int]]:
    return [served.run(chat, i)["tokens"] for i in inputs]


def together(served, inputs: list[dict]) -> list[dict]:
    results = served.run_many([(chat, i) for i in inputs])
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_concurrent_generations_finish_with_the_tokens_they_get_alone(scarce):
    inputs = [{"prompt": p, "n": 80} for p in prompts(6)]
    before = scarce.stats()
    results = together(scarce, inputs)
    assert [r["tokens"] for r in results] == solo(scarce, inputs)
    stats = scarce.stats()
    assert stats.suspensions > before.suspensions, "the workload needed more pages than the replica has"
    assert stats.offloaded > before.offloaded, "some suspended pages waited in host memory"
    assert stats.working == 0 and stats.contexts == 0 and stats.suspended == 0 and stats.waiting == 0


def test_a_burst_of_inferlets_all_finish(scarce):
    inputs = [{"prompt": p, "n": 48} for p in prompts(10)]
    results = together(scarce, inputs)
    assert [r["tokens"] for r in results] == solo(scarce, inputs)


def test_high_fanout_forks_under_contention(scarce):
    async def fanout(input):
        with Context(Model.load("default")) as parent:
            parent.user("A shared prefix that every branch keeps: the quick brown fox jumps over the lazy dog.")
            await parent.flush()
            branches = []
            for i in range(8):
                child = parent.fork()
                child.append(Model.load("default").tokenizer().encode(f" Branch {i}:"))
                branches.append(child)
            outs = await asyncio.gather(
                *(b.generate(Sampler.argmax(), max_tokens=40, auto_flush=False).collect_tokens() for b in branches)
            )
            for b in branches:
                b.release()
            return outs

    async def one_branch(input):
        with Context(Model.load("default")) as ctx:
            ctx.user("A shared prefix that every branch keeps: the quick brown fox jumps over the lazy dog.")
            await ctx.flush()
            ctx.append(Model.load("default").tokenizer().encode(f" Branch {input['i']}:"))
            return await ctx.generate(Sampler.argmax(), max_tokens=40, auto_flush=False).collect_tokens()

    outs = scarce.run(fanout)
    assert outs == [scarce.run(one_branch, {"i": i}) for i in range(8)]
    assert scarce.stats().working == 0


_readers_started: set[int] = set()  # readers that have generated a token (all inferlets of a run share a process)


def long_text(seed: int) -> list[int]:
    """300 tokens (19 pages) no other reader shares, so prefix caching cannot pack two readers into one pool."""
    return [100 + (i * 7 + seed * 13) % 50 for i in range(300)]


async def reader(input):
    """Continues its own long text greedily at bid 1: two of them need twice the pool, one alone nearly all of it.
    Steps one by one, or (``chained``) collects, so the replica never sees it between passes."""
    with Context(Model.load("default")) as ctx:
        ctx.set_bid(1.0)
        ctx.append(long_text(input["seed"]))
        gen = ctx.generate(Sampler.argmax(), max_tokens=60)
        if input.get("chained"):
            collecting = asyncio.ensure_future(gen.collect_tokens())
            while ctx.seq_len <= len(long_text(0)) and not collecting.done():
                await asyncio.sleep(0.002)
            _readers_started.add(input["seed"])
            return {"tokens": await collecting, "ended": time.monotonic()}
        tokens = []
        async for step in gen:
            tokens += (await step.execute()).tokens
            _readers_started.add(input["seed"])
        return {"tokens": tokens, "ended": time.monotonic()}


async def latecomer(input):
    """Starts once both readers have begun, then generates 80 tokens (6 pages: more than a lone reader leaves)."""
    for _ in range(6000):
        if len(_readers_started) == 2:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the readers never started")
    return await chat(input)


@pytest.mark.parametrize("chained", [False, True], ids=["stepping", "chained"])
@pytest.mark.parametrize("bid", [100.0, 0.5], ids=["outbids", "underbids"])
def test_memory_goes_to_the_highest_bidder(scarce, bid, chained):
    """Two readers at bid 1 each need most of the pool until they end. A latecomer outbidding them takes memory at
    once (from chained readers, at their next step) and finishes before both; one underbidding them never gets the
    room it needs while either wants it, so it finishes after both."""
    _readers_started.clear()
    late = {"prompt": "The latecomer's story begins", "n": 80, "bid": bid}
    readers = [(reader, {"seed": i, "chained": chained}) for i in range(2)]
    results = scarce.run_many([*readers, (latecomer, late)])
    for r in results:
        if isinstance(r, BaseException):
            raise r
    *readers, top = results
    if bid > 1.0:
        assert all(top["ended"] < r["ended"] for r in readers)
    else:
        assert all(top["ended"] > r["ended"] for r in readers)
    assert top["tokens"] == solo(scarce, [late])[0]
    assert [r["tokens"] for r in readers] == [scarce.run(reader, {"seed": i})["tokens"] for i in range(2)]
    stats = scarce.stats()
    assert stats.working == 0 and stats.suspended == 0 and stats.waiting == 0


def test_a_context_suspended_by_hand_comes_back_intact(scarce):
    async def suspending(input):
        with Context(Model.load("default")) as ctx:
            ctx.append(MEMORY[: input["n"]])
            await ctx.flush()
            if input["suspend"]:
                ctx.suspend()
                ctx.suspend()  # already suspended: nothing to do
            ctx.cue()
            return await ctx.generate(Sampler.argmax(), max_tokens=8).collect_tokens()

    for n in (40, 200):  # a context that is all working pages / one with committed pages (some may stay cached)
        before = scarce.stats()
        suspended = scarce.run(suspending, {"n": n, "suspend": True})
        after = scarce.stats()
        assert after.suspensions == before.suspensions + 1 and after.suspended == 0
        assert suspended == scarce.run(suspending, {"n": n, "suspend": False})


def test_kv_that_could_not_be_restored_refuses_to_be_suspended(scarce):
    async def masked(input):
        with Context(Model.load("default")) as ctx:
            # written under a custom (here: causal) attention mask, so its KV is salted: never recomputed
            await ctx.forward().input([100, 101, 102]).attention_mask([[0, 1], [0, 2], [0, 3]]).execute()
            try:
                ctx.suspend()
            except ValueError as e:
                refused = str(e)
            else:
                refused = None
            ctx.append([103])
            await ctx.flush()  # the context is untouched and goes on working
            return refused, ctx.seq_len

    refused, seq_len = scarce.run(masked)
    assert refused is not None and "cannot be suspended" in refused and seq_len == 4
    assert scarce.stats().suspended == 0


def test_idle_yields_pages_to_a_bidder(scarce):
    async def holder_and_bidder(input):
        model = Model.load("default")
        with Context(model) as holder, Context(model) as bidder:
            holder.set_bid(5.0)
            holder.append(MEMORY)  # 20 of the 24 pages
            await holder.flush()
            bidder.set_bid(1.0)
            bidder.user(input["prompt"])
            with holder.idle():
                out = await bidder.generate(Sampler.argmax(), max_tokens=80).collect_tokens()
            holder.cue()
            after = await holder.generate(Sampler.argmax(), max_tokens=8).collect_tokens()
            return out, after

    async def holder_alone(input):
        with Context(Model.load("default")) as holder:
            holder.append(MEMORY)
            await holder.flush()
            holder.cue()
            return await holder.generate(Sampler.argmax(), max_tokens=8).collect_tokens()

    before = scarce.stats().suspensions
    prompt = "While the holder idles, the bidder writes"
    out, after = scarce.run(holder_and_bidder, {"prompt": prompt})
    assert scarce.stats().suspensions > before, "the idle holder gave its pages up"
    assert out == solo(scarce, [{"prompt": prompt, "n": 80}])[0]
    assert after == scarce.run(holder_alone), "the holder came back intact"


def test_a_bad_bid_is_refused_in_the_inferlet(scarce):
    async def main(input):
        with Context(Model.load("default")) as ctx:
            ctx.set_bid(float("nan"))

    with pytest.raises(ValueError, match="finite number of credits"):
        scarce.run(main)


def test_a_context_with_a_pass_in_flight_gives_its_pages_up_when_its_next_pass_begins():
    """Chained steps leave a generating context no moment between passes, so a suspension asked of it (by a higher
    bidder making room, or by the market) waits for its next pass to begin instead of being dropped."""
    from pie_workers.engine import ContextTable, PageStore
    from pie_workers.engine.record import EngineContexts, Session
    from pie_workers.engine.residency import Residency
    from pie_workers.engine.scheduler import BatchLimits, BatchScheduler
    from pie_workers.wire.capability import Capability

    records = EngineContexts(ContextTable(PageStore(4, 16)))
    contexts = records.table
    residency = Residency(records, BatchScheduler(None, BatchLimits()))
    users = ("alice", "bob", "carol", "dave")
    session = {
        name: Session(name, name, name, name, float("inf"), Capability(name, name, float("inf"))) for name in users
    }
    low, high = records.create(session["alice"]), records.create(session["bob"])
    contexts.reserve(low.id, 4)
    contexts.record(low.id, list(range(50)), list(range(50)))
    residency.set_bid(low, 0.0)
    residency.set_bid(high, 5.0)

    low.gate.take_now()  # a pass in flight
    assert not residency.try_now(high, 2), "pages in a running batch are not free yet"
    assert low.deferred and low.suspended is None
    assert not residency.try_now(high, 2) and low.deferred, "asked once, counted once"
    residency.pass_begins(low)
    assert low.suspended is not None and not low.deferred
    assert residency.try_now(high, 2)

    idle, busy = records.create(session["carol"]), records.create(session["dave"])  # as market decisions apply
    for record in (idle, busy):
        contexts.reserve(record.id, 1)
        contexts.record(record.id, [1], [0])
    busy.gate.take_now()
    residency.suspend_or_defer(idle)
    residency.suspend_or_defer(busy)
    assert idle.suspended is not None, "an idle context goes at once"
    assert busy.deferred and busy.suspended is None
    records.destroy(busy)
    assert not busy.deferred, "a released context owes nothing"
