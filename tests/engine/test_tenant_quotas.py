"""Per-user quotas a replica enforces (``[limits]``, ``engine/tenancy.py``): alice goes over each one on the real
engine over the tiny Llama, driven as its channel drives it (no SDK, so nothing of the SDK's own checks helps), and
gets an error naming the limit, while bob's snapshots, adapters and passes on the same replica are untouched.

Snapshots (count, pages; salted ones let go of under memory pressure, the heaviest user's first), adapters (rank
by the model's dimensions and ``adapter_max_rank``, count, bytes) and the token budget a capability grants.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
from inferlet import QuotaExceeded as QuotaExceededInSdk
from pie_workers.engine.contexts import ContextError
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.engine.service import ReplicaEngine
from pie_workers.engine.tenancy import QuotaExceeded, TenantLimits, TokenBudgetExhausted
from pie_workers.wire.batch import Slot, SlotKind
from pie_workers.wire.capability import mint
from pie_workers.wire.codec import slot_to_wire
from pie_workers.wire.messages import AdapterReply, ContextReply, PassKind, PassReply, PassRequest, decode, encode
from support.engine_harness import SAMPLER
from support.sdk_host import TRUST

PAGE = 16  # tokens per page of the tiny Llama's runner (``engine_harness.PAGES`` = 64 pages)


def session(user: str, budget: int | None = None, instance: str | None = None) -> str:
    """A session string as the channel names a sender: ``capability/session``, the capability minted for ``user``
    (and ``instance``) by the trusted side, granting ``budget`` tokens."""
    capability = mint(TRUST.secret, user, instance or uuid.uuid4().hex, 3600, token_budget=budget)
    return f"{capability}/{uuid.uuid4().hex[:8]}"


def text(seed: int, n: int) -> list[int]:
    """Tokens no other text shares a page with."""
    return [100 + (i * 7 + seed * 13) % 50 + 60 * (seed % 40) for i in range(n)]


class Tenants:
    """The replica engine in this process under ``limits``, with its batch scheduler running."""

    def __init__(self, runner, limits: TenantLimits):
        self.engine = ReplicaEngine(runner, BatchLimits(), secret=TRUST.secret, tenants=limits)
        self.batches = asyncio.get_running_loop().create_task(self.engine.scheduler.run())

    async def call(self, who: str, op: str, *args):
        return await self.engine._handle(who, op, list(args), None)

    async def forward(self, who: str, ctx: int, tokens: list[int], position: int, slot=SAMPLER, **fields) -> PassReply:
        """A pass sampling its last row (or with another ``slot`` there); ``fields``: more of ``PassRequest``'s
        (adapter, chained steps...)."""
        future = asyncio.get_running_loop().create_future()

        def answer(error, result):
            future.set_exception(error) if error else future.set_result(decode(PassReply, result))

        rows = max(len(tokens), 1)
        request = PassRequest(
            ctx, tokens=tokens, positions=list(range(position, position + rows)), slots=[[rows - 1, slot]], **fields
        )
        self.engine._handle(who, "forward", [encode(request)], answer)
        return await future

    async def context(self, who: str, tokens: list[int], **fields) -> int:
        """A new context holding ``tokens`` (written under ``fields``: an adapter makes its KV unrecomputable)."""
        ctx = await self.call(who, "create")
        await self.forward(who, ctx, tokens, 0, **fields)
        return ctx

    async def adapter(self, who: str, name: str, rank: int = 4) -> int:
        return decode(AdapterReply, await self.call(who, "adapter_create", name, rank)).id

    def stop(self) -> None:
        self.batches.cancel()


def run(runner, limits: TenantLimits, body):
    async def main():
        tenants = Tenants(runner, limits)
        try:
            return await asyncio.wait_for(body(tenants), 120)  # a failure guard: a pass that waits for ever
        finally:
            tenants.stop()

    return asyncio.run(main())


# -- snapshots ------------------------------------------------------------------------------------------------------


def test_snapshots_past_the_users_count_are_refused_and_bobs_are_untouched(runner):
    async def body(t: Tenants):
        alice, bob = session("alice"), session("bob")
        for who in (alice, bob):
            ctx = await t.context(who, text(1, 20))
            await t.call(who, "save", ctx, "first")
            await t.call(who, "save", ctx, "second")
        with pytest.raises(QuotaExceeded, match=r"snapshots_per_user = 2"):
            await t.call(alice, "save", await t.context(alice, text(2, 20)), "third")
        opened = decode(ContextReply, await t.call(bob, "open", "second"))
        return opened.seq_len, t.engine.contexts.snapshots_of("alice"), t.engine.contexts.snapshots_of("bob")

    seq_len, alices, bobs = run(runner, TenantLimits(snapshots_per_user=2), body)
    assert alices == bobs == ["first", "second"]  # nothing of alice's refusal touched anyone's snapshots
    assert seq_len == 20


def test_snapshot_pages_past_the_users_bound_are_refused(runner):
    async def body(t: Tenants):
        alice, bob = session("alice"), session("bob")
        big = await t.context(alice, text(3, 5 * PAGE))  # 5 pages
        await t.call(alice, "save", big, "kept")
        with pytest.raises(QuotaExceeded, match=r"snapshot_pages_per_user = 8"):
            await t.call(alice, "snapshot", big)  # 5 more would be 10
        with pytest.raises(QuotaExceeded, match=r"snapshot_pages_per_user = 8"):
            await t.call(alice, "keep", big, "moved")
        mine = await t.context(bob, text(4, 5 * PAGE))
        await t.call(bob, "keep", mine, "his")
        return t.engine.contexts.snapshot_usage("alice"), t.engine.contexts.snapshot_usage("bob")

    alices, bobs = run(runner, TenantLimits(snapshot_pages_per_user=8), body)
    assert alices == (1, 5) and bobs == (1, 5)


def test_salted_snapshots_are_let_go_of_under_pressure_the_heaviest_users_first(runner):
    """Snapshots written under an adapter cannot be recomputed, and used to pin their pages for good: now they are
    let go of when memory runs short, the user whose such snapshots hold the most pages first. Bob's small one
    survives alice's large ones, and his long pass gets its pages instead of waiting for ever."""

    async def body(t: Tenants):
        alice, bob = session("alice"), session("bob")
        alices, bobs = await t.adapter(alice, "a"), await t.adapter(bob, "b")
        for i in range(2):  # 2 x 14 pages
            ctx = await t.context(alice, text(10 + i, 14 * PAGE - 1), adapter=alices)
            await t.call(alice, "keep", ctx, f"salted-{i}")
        small = await t.context(bob, text(20, 2 * PAGE - 1), adapter=bobs)
        await t.call(bob, "keep", small, "his")
        assert t.engine.contexts.snapshot_usage("alice") == (2, 28)
        long = await t.context(bob, text(21, 40 * PAGE))  # 41 pages: more than the snapshots leave free
        assert decode(ContextReply, await t.call(bob, "open", "his")).seq_len == 2 * PAGE - 1
        with pytest.raises(ContextError, match="was let go of when this replica's memory ran short"):
            await t.call(alice, "open", "salted-0")
        await t.call(alice, "delete", "salted-0")  # the name is free again
        return t.engine.contexts.snapshots_of("alice"), t.engine.contexts.seq_len(long)

    left, long_len = run(runner, TenantLimits(), body)
    assert long_len == 40 * PAGE
    assert "salted-0" not in left


# -- adapters -------------------------------------------------------------------------------------------------------


def test_an_adapter_rank_past_the_models_dimensions_or_the_limit_is_refused(runner):
    async def body(t: Tenants):
        alice, bob = session("alice"), session("bob")
        his = await t.adapter(bob, "his")
        errors = {}
        for rank in (2048, 65):
            try:
                await t.call(alice, "adapter_create", "huge", rank)
            except ValueError as e:
                errors[rank] = e
        ctx = await t.context(bob, text(5, 10), adapter=his)
        return errors, t.engine.adapters._adapters, t.engine.contexts.seq_len(ctx)

    errors, adapters, seq_len = run(runner, TenantLimits(), body)
    assert isinstance(errors[2048], QuotaExceeded) and "adapter_max_rank = 256" in str(errors[2048])
    # the tiny Llama's v_proj is 128 -> 64: a larger rank only costs memory
    assert "LoRA rank 65 exceeds this model's k_proj" in str(errors[65]) or "v_proj" in str(errors[65])
    assert [a.owner for a in adapters.values()] == ["bob"] and seq_len == 10


def test_adapters_past_the_users_count_or_bytes_are_refused(runner):
    one = 4 * 4 * 8 * (128 + 128 + 128 + 64)  # float32 bytes of a rank-8 q_proj + v_proj adapter on the tiny Llama

    async def body(t: Tenants):
        alice, bob = session("alice"), session("bob")
        first = await t.adapter(alice, "one", rank=8)
        await t.adapter(alice, "two", rank=2)
        with pytest.raises(QuotaExceeded, match=r"adapters_per_user = 2"):
            await t.adapter(alice, "three", rank=1)
        with pytest.raises(QuotaExceeded, match=r"adapters_per_user = 2"):
            await t.call(alice, "adapter_fork", first, "copy")
        await t.call(alice, "adapter_destroy", first)
        with pytest.raises(QuotaExceeded, match=rf"adapter_bytes_per_user = {2 * one}"):
            await t.adapter(alice, "big", rank=16)  # 2 x one, with "two" still held
        his = [await t.adapter(bob, name, rank=8) for name in ("x", "y")]
        ctx = await t.context(bob, text(6, 10), adapter=his[1])
        return sorted(a.name for a in t.engine.adapters._adapters.values() if a.owner == "bob"), ctx

    bobs, _ = run(runner, TenantLimits(adapters_per_user=2, adapter_bytes_per_user=2 * one), body)
    assert bobs == ["x", "y"]


# -- the token budget -----------------------------------------------------------------------------------------------


def test_the_replica_refuses_passes_past_the_capabilitys_token_budget(runner):
    """No SDK here: the passes come straight to the engine, as a program that bypassed the SDK's own count would
    send them. The budget travels in alice's capability; bob, on the same replica, has none."""

    async def body(t: Tenants):
        instance = uuid.uuid4().hex
        alice, bob = session("alice", budget=6, instance=instance), session("bob")
        ctx = await t.call(alice, "create")
        reply = await t.forward(alice, ctx, text(7, 5), 0)  # 1 token
        assert len(reply.slots) == 1
        chained = await t.forward(alice, ctx, [], 5, kind=PassKind.CHAINED, steps=50, stop_ids=[])
        walked = len(chained.walk)  # cut to the 5 tokens left
        with pytest.raises(TokenBudgetExhausted, match=r"token budget exhausted: 6 tokens generated, the budget is 6"):
            await t.forward(alice, ctx, [1], 5 + walked)
        again = session("alice", budget=6, instance=instance)  # a new session of the same instance: still spent
        other = await t.call(again, "create")
        with pytest.raises(TokenBudgetExhausted, match="token budget exhausted"):
            await t.forward(again, other, text(8, 4), 0)
        probed = await t.forward(again, other, text(8, 4), 0, slot=slot_to_wire(Slot(SlotKind.ENTROPY)))
        assert probed.slots[0][0] == "e"  # a pass that samples no token is not refused
        mine = await t.call(bob, "create")
        await t.forward(bob, mine, text(9, 5), 0)
        bobs_chain = await t.forward(bob, mine, [], 5, kind=PassKind.CHAINED, steps=20, stop_ids=[])
        return walked, len(bobs_chain.walk)

    walked, bobs = run(runner, TenantLimits(), body)
    assert walked == 5 and bobs == 20


# -- through a served replica: the GCS's adapter store, and the budget with the SDK's own check switched off ----------

RANK_8 = 4 * 4 * 8 * (128 + 128 + 128 + 64)  # float32 bytes of a rank-8 q_proj + v_proj adapter on the tiny Llama


@pytest.fixture(scope="module")
def stored(ray_session, tiny_llama):
    """A replica whose snapshots and adapters the cluster's directory keeps, with room there for two snapshot names
    and three rank-8 adapters a user."""
    from pie_cluster.hosts.run import endpoints_for
    from pie_cluster.stores.directory import get_or_create_directory
    from pie_workers.replica import Replica
    from pie_workers.runner import RunnerSettings
    from support.sdk_host import Served

    namespace = f"pie-test-quotas-{uuid.uuid4().hex[:8]}"
    directory = get_or_create_directory(namespace, store_bytes_per_user=3 * RANK_8, snapshots_per_user=2)
    replica = Replica(
        tiny_llama, 1, RunnerSettings(num_pages=64), cpus_per_rank=1, engine=BatchLimits(), secret=TRUST.secret,
        directory=(directory, "default"),
    )  # fmt: skip
    yield Served(replica, endpoints_for("default", replica))
    replica.shutdown()
    ray.kill(directory)


async def make_adapters(input):
    from inferlet import Adapter, Model

    model, made, refused = Model.load("default"), [], []
    for name in input["names"]:
        try:
            Adapter.create(model, name, rank=8)
            made.append(name)
        except QuotaExceededInSdk as e:
            refused.append(str(e))
    return made, refused, [Adapter.open(model, name) is not None for name in input["names"]]


def test_adapter_weights_past_the_users_bytes_in_the_gcs_are_refused(stored):
    alice, bob = f"alice-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    made, refused, present = stored.run(make_adapters, {"names": ["a", "b", "c", "d"]}, user=alice)
    assert made == ["a", "b", "c"] and present == [True, True, True, False]  # nothing of "d" was kept anywhere
    assert len(refused) == 1 and f"[limits] adapter_store_bytes_per_user = {3 * RANK_8}" in refused[0]
    assert stored.run(make_adapters, {"names": ["a", "b", "c"]}, user=bob) == (["a", "b", "c"], [], [True] * 3)


async def save_snapshots(input):
    from inferlet import Context, Model

    model, refused = Model.load("default"), []
    with Context(model) as ctx:
        ctx.append(text(30, 40))
        await ctx.flush()
        for name in input["names"]:
            try:
                ctx.save(name)
            except QuotaExceededInSdk as e:
                refused.append(str(e))
    opened = []
    for name in input["names"]:
        again = Context.open(model, name)
        opened.append(None if again is None else again.seq_len)
        if again is not None:
            again.release()
    return refused, opened


def test_snapshot_names_past_the_users_count_in_the_directory_are_refused(stored):
    """The replica bounds the snapshots it holds; the directory bounds the names (and lineages) it keeps, so
    snapshots let go of under memory pressure cannot pile up there either."""
    alice, bob = f"alice-{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}"
    refused, opened = stored.run(save_snapshots, {"names": ["one", "two", "three"]}, user=alice)
    assert len(refused) == 1 and "[limits] snapshots_per_user = 2" in refused[0] and "in the cluster" in refused[0]
    assert opened == [40, 40, None]  # the refused one is kept nowhere
    assert stored.run(save_snapshots, {"names": ["one", "two"]}, user=bob) == ([], [40, 40])


async def spend_past_the_budget(input):
    """Switch the SDK's own count off (the program runs in the user's process: it can) and keep generating."""
    from inferlet import Context, Model, Sampler, TokenBudgetExhausted, runtime

    runtime.current().token_budget = None
    with Context(Model.load("default")) as ctx:
        ctx.user("Keep talking.")
        try:
            await ctx.generate(Sampler.argmax(), max_tokens=64, stop=[]).collect_tokens()
        except TokenBudgetExhausted as e:
            return str(e), runtime.current().tokens_generated
    return None, runtime.current().tokens_generated


def test_a_budget_the_sdk_ignores_is_still_enforced_by_the_replica(served):
    from pie_cluster.hosts.run import run_inferlet

    instance = uuid.uuid4().hex
    capability = mint(TRUST.secret, "alice", instance, 3600, token_budget=20)
    error, generated = asyncio.run(
        run_inferlet(spend_past_the_budget, {}, served.endpoints, "alice", instance_id=instance, capability=capability)
    )
    assert error is not None and "token budget exhausted" in error and "the budget is 20" in error
    assert generated == 20
    assert served.run(spend_past_the_budget, user="bob") == (None, 64)  # bob, on the same replica, has no budget
