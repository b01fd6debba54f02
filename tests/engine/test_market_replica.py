"""The market wired to a real replica: rent and make cost actually charged, affordability enforced in the replica,
the Generator's default bid, and every wallet closed when its inferlet ends.

The replica has 24 pages of 16 tokens; two readers of 300-token texts need twice that, so memory is contended.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import ray
from inferlet import Context, Model, Sampler, scheduling
from pie_workers.engine.engine_stats import EngineStats
from pie_workers.engine.market_link import ROUND_S
from pie_workers.wire.pages import pages_for
from support.sdk_host import TRUST

PAGES = 24


@pytest.fixture(scope="module")
def replica(ray_session, tiny_llama, market):
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings

    settings = RunnerSettings(num_pages=PAGES, host_pages=0)  # no host buffer: every suspension is recomputed
    replica = Replica(
        tiny_llama, 1, settings, cpus_per_rank=1, engine=BatchLimits(), market=market, secret=TRUST.secret
    )
    yield replica
    replica.shutdown()


def run_all(replica, market, runs: list[tuple]) -> list:
    """Run (main, input, endowment) triples concurrently, each with its own wallet on ``market``."""
    from pie_cluster.hosts.run import endpoints_for, run_inferlet

    endpoints = endpoints_for("default", replica)

    async def all_of():
        return await asyncio.gather(
            *(
                run_inferlet(m, i, endpoints, "alice", **TRUST.instance("alice"), market=market, endowment=e)
                for m, i, e in runs
            )
        )

    return asyncio.run(all_of())


def stats(replica) -> EngineStats:
    return ray.get(replica.leader.engine_stats.remote())


def long_text(seed: int) -> list[int]:
    return [100 + (i * 7 + seed * 13) % 50 for i in range(300)]


_started: set[int] = set()


async def reader(input):
    """Continues a long text greedily; records the highest page price it saw and its balance along the way. With
    ``pause``, it holds its pages that long between steps, so that a rival waits in line across market rounds."""
    model = Model.load("default")
    with Context(model) as ctx:
        if "bid" in input:
            ctx.set_bid(input["bid"])
        ctx.append(long_text(input["seed"]))
        tokens, prices, paid = [], [0.0], [0.0]
        endowment = scheduling.readings(model)["endowment"]
        async for step in ctx.generate(Sampler.argmax(), max_tokens=input.get("n", 60), auto_flush=False):
            tokens += (await step.execute()).tokens
            _started.add(input["seed"])
            prices.append(scheduling.rent(ctx))
            paid.append(scheduling.readings(model)["paid"])
            await asyncio.sleep(input.get("pause", 0.0))
        return {
            "paid": max(paid),
            "tokens": tokens,
            "price": max(prices),
            "balance": scheduling.balance(model),
            "endowment": endowment,
            "ended": asyncio.get_running_loop().time(),
        }


def test_contention_charges_rent_and_make_cost_and_every_credit_is_accounted_for(replica, market):
    before = ray.get(market.ledger.remote())
    # each reader's 60 steps span several market rounds (ROUND_S apart): contention is priced while it lasts
    readers = [(reader, {"seed": s, "pause": 2 * ROUND_S / 10}, 1000.0) for s in (0, 1)]
    solo = [run_all(replica, market, [run])[0]["tokens"] for run in readers]
    together = run_all(replica, market, readers)
    assert [r["tokens"] for r in together] == solo  # suspension and recomputation lose nothing
    assert max(r["price"] for r in together) > 0, "two readers that cannot both fit set a price"
    assert max(r["paid"] for r in together) > 0, "and the resident one pays rent"
    assert all(r["balance"] >= 0 for r in together)  # default bids never spend a process below zero
    after = ray.get(market.ledger.remote())
    assert after.balanced and after.held == before.held, "a wallet outlived its inferlet"
    # the pages made were paid for at 1 credit each: each run needs ceil((300 + 60) / 16) of them; the solo runs
    # make all of theirs, the later runs adopt some of them from the prefix cache instead (and do not pay for those)
    pages = math.ceil(360 / 16)
    assert 2 * pages * 1_000_000 <= after.burned - before.burned <= 4 * pages * 1_000_000
    assert after.returned - before.returned == after.issued - before.issued - (after.burned - before.burned)
    s = stats(replica)
    assert s.market_rounds > 0 and s.working == 0 and s.suspended == 0 and s.waiting == 0
    assert s.suspensions > 0 and s.offloaded == 0  # suspended pages were dropped and recomputed


async def latecomer(input):
    """Once both readers have begun, takes a short prompt to 80 tokens at a high bid it may not be able to pay."""
    for _ in range(6000):
        if len(_started) == 2:
            break
        await asyncio.sleep(0.01)
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.set_bid(input["bid"])
        ctx.user("The latecomer's story begins")
        await ctx.flush()  # its context is in the market's reports from here on
        rounds = (await input["leader"].engine_stats.remote()).market_rounds
        while (await input["leader"].engine_stats.remote()).market_rounds < rounds + 2:
            await asyncio.sleep(0.01)  # the market has capped what it can afford
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=80).collect_tokens()
        return {"tokens": tokens, "ended": asyncio.get_running_loop().time()}


@pytest.mark.parametrize("endowment", [1e6, 0.0], ids=["funded", "broke"])
def test_a_high_bid_counts_only_as_far_as_its_process_can_pay(replica, market, endowment):
    """A latecomer bidding 100 per page against two readers bidding 1 finishes first when it has the credits, and
    last when it has none: the market caps its bid at 0, and the replica ranks it by the capped bid."""
    _started.clear()
    late_input = {"bid": 100.0, "leader": replica.leader}  # (inferlets run in this process: it takes a Ray handle)
    runs = [(reader, {"seed": s, "bid": 1.0}, 1e6) for s in (0, 1)] + [(latecomer, late_input, endowment)]
    *readers, late = run_all(replica, market, runs)
    if endowment > 0:
        assert all(late["ended"] < r["ended"] for r in readers)
    else:
        assert all(late["ended"] > r["ended"] for r in readers)


def test_the_generator_bids_by_default_unless_told_otherwise(replica, market):
    async def stepping(input):
        model = Model.load("default")
        out = {}
        with Context(model) as ctx:
            ctx.user("A default bid")
            gen = ctx.generate(Sampler.argmax(), max_tokens=16)
            async for step in gen:
                await step.execute()
                if gen.tokens_generated == 4:
                    break
            readings = gen.state.bid_basis  # what this step's bid was computed from
            pages = pages_for(ctx.seq_len - 1, ctx.page_size)  # the KV the bid was made for (before the step)
            out["bid"] = ctx.bid
            bids = await input["leader"].__ray_call__.remote(
                lambda worker: {r.id: r.bid for r in worker.engine.records}
            )
            out["engine_bid"] = bids[ctx.id]  # it reached the replica, riding in the step's forward request
            out["expected"] = scheduling.default_bid(
                readings["balance"], max(pages, 1), 16 - 3, 1.0, ctx.page_size, readings["dividend"]
            )
            with ctx.idle():
                await ctx.generate(Sampler.argmax(), max_tokens=2).collect_tokens()
                out["idle"] = ctx.bid
            ctx.set_bid(0.25)
            await ctx.generate(Sampler.argmax(), max_tokens=2).collect_tokens()
            out["explicit"] = ctx.bid
        return out

    [got] = run_all(replica, market, [(stepping, {"leader": replica.leader}, 500.0)])
    assert got["bid"] > 0 and got["bid"] == pytest.approx(got["expected"]) and got["engine_bid"] == got["bid"]
    assert got["idle"] == 0.0 and got["explicit"] == 0.25


def test_without_a_market_there_are_no_credits_to_read(ray_session, tiny_llama):
    from pie_cluster.hosts.run import endpoints_for, run_inferlet
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings

    async def reads(input):
        model = Model.load("default")
        with Context(model) as ctx:
            ctx.user("no market here")
            await ctx.generate(Sampler.argmax(), max_tokens=3).collect_tokens()
            bid = ctx.bid
        try:
            scheduling.balance(model)
        except RuntimeError as e:
            return {"bid": bid, "error": str(e)}

    bare = Replica(
        tiny_llama, 1, RunnerSettings(num_pages=64), cpus_per_rank=1, engine=BatchLimits(), secret=TRUST.secret
    )
    try:
        got = asyncio.run(run_inferlet(reads, {}, endpoints_for("default", bare), "alice", **TRUST.instance("alice")))
    finally:
        bare.shutdown()
    assert got["bid"] == 0.0 and "without the KV-page market" in got["error"]


def test_pages_made_are_charged_to_their_maker_and_taking_a_snapshot_makes_none(replica, market):
    async def saver(input):
        with Context(Model.load("default")) as ctx:
            ctx.append(long_text(7)[:50])  # 4 pages, the last partly filled
            await ctx.flush()
            ctx.save("market-made")
            child = ctx.fork()  # a copy of the partly filled page: one more page made
            child.release()

    async def taker(input):
        ctx = Context.take(Model.load("default"), "market-made")
        assert ctx is not None and ctx.seq_len == 50
        ctx.release()

    before = ray.get(market.ledger.remote())
    run_all(replica, market, [(saver, {}, 100.0)])
    made = ray.get(market.ledger.remote())
    run_all(replica, market, [(taker, {}, 100.0)])
    after = ray.get(market.ledger.remote())
    assert made.burned - before.burned == (math.ceil(50 / 16) + 1) * 1_000_000
    assert after.burned == made.burned  # the snapshot's pages changed hands; nobody made them


def test_a_new_inferlets_first_steps_bid_from_its_opening_balance(replica, market):
    """The first steps bid from what the wallet opened with (no market round trip before the first pass); once a
    round period has passed, from the replica's reading of the wallet."""

    async def stepping(input):
        model = Model.load("default")
        bases, first_bid = [], None
        with Context(model) as ctx:
            ctx.user("An opening bid")
            gen = ctx.generate(Sampler.argmax(), max_tokens=12)
            async for step in gen:
                await step.execute()
                bases.append(dict(gen.state.bid_basis))
                if first_bid is None:
                    first_bid = ctx.bid
                await asyncio.sleep(0.06)  # past a round period: the next step refreshes its reading
        return {"bases": bases, "first_bid": first_bid}

    [got] = run_all(replica, market, [(stepping, {}, 500.0)])
    opening = got["bases"][0]
    assert opening == {"balance": 500.0, "endowment": 500.0, "dividend": 0.0, "paid": 0.0}
    assert got["first_bid"] > 0
    assert "price" in got["bases"][-1] and got["bases"][-1]["endowment"] == 500.0  # the replica's reading


def test_a_burst_of_endings_pays_for_every_page_before_the_wallets_close(replica, market):
    """Endings that come together share the replica's settling round; each still pays its make cost before its
    wallet closes (a page reported after would be nobody's, and the books would burn less)."""

    async def writer(input):
        with Context(Model.load("default")) as ctx:
            ctx.append(long_text(input["seed"])[: 16 * 3])  # 3 pages, none shared with the others
            await ctx.flush()

    before = ray.get(market.ledger.remote())
    run_all(replica, market, [(writer, {"seed": 20 + s}, 100.0) for s in range(12)])
    after = ray.get(market.ledger.remote())
    assert after.burned - before.burned == 12 * 3 * 1_000_000
    assert after.balanced and after.held == before.held
