"""The prefix cache per tenant, on the replica engine itself (in this process, over the tiny Llama's real runner):
a cached page is found only by lookups of the user who wrote it, under the cache salt its context was made with,
unless the operator shares prefixes cluster-wide (``[cache] share = "cluster"``); and the ``stats`` a connection
reads cover only its own user. Alice attacks, Bob's work is the secret: she must not learn from a prefix hit (or a
counter) that he sent a prompt, and his own reuse, forks, snapshots and restores work as before.
"""

from __future__ import annotations

import asyncio

import pytest
from inferlet._lineage import Lineage
from pie_workers.engine.scheduler import BatchLimits
from pie_workers.engine.service import ReplicaEngine
from pie_workers.engine.tenancy import TenantLimits
from pie_workers.wire.batch import Slot
from pie_workers.wire.codec import slot_to_wire
from pie_workers.wire.messages import MAX_CACHE_SALT, ContextReply, PassReply, PassRequest, decode, encode
from support.engine_harness import PROMPT
from support.sdk_host import TRUST

GREEDY = slot_to_wire(Slot.argmax())
SECRET = PROMPT + [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36]  # 49 tokens
CACHED = 48  # the full pages before the last token, which is always computed


class Replica:
    """A replica engine over the real runner, and the sessions of its users (one inferlet run each)."""

    def __init__(self, runner, shared: bool = False):
        tenants = TenantLimits(shared_prefixes=shared)
        self.engine = ReplicaEngine(runner, BatchLimits(), secret=TRUST.secret, tenants=tenants)
        self.batches = asyncio.get_running_loop().create_task(self.engine.scheduler.run())
        self.sessions = {user: f"{TRUST.instance(user)['capability']}/s" for user in ("alice", "bob")}

    async def call(self, user: str, op: str, *args):
        return await self.engine._handle(self.sessions[user], op, list(args), None)

    def forward(self, user: str, ctx: int, tokens: list[int], position: int) -> asyncio.Future:
        """A greedy pass over ``tokens``; a future of its sampled token."""
        future = asyncio.get_running_loop().create_future()

        def answer(error, result):
            if error:
                future.set_exception(error)
            else:
                future.set_result(decode(PassReply, result).slots[0][1])

        rows, positions = len(tokens), list(range(position, position + len(tokens)))
        request = PassRequest(ctx, tokens=tokens, positions=positions, slots=[[rows - 1, GREEDY]])
        self.engine._handle(self.sessions[user], "forward", [encode(request)], answer)
        return future

    async def generate(self, user: str, ctx: int, prompt: list[int], n: int = 6) -> list[int]:
        """``n`` greedy tokens after ``prompt`` on ``ctx``, appended to what it holds (suspended or not)."""
        position = self.engine.residency.seq_len(self.engine.records.get(ctx))
        token = await self.forward(user, ctx, prompt, position)
        out = [token]
        for i in range(n - 1):
            out.append(await self.forward(user, ctx, [out[-1]], position + len(prompt) + i))
        return out

    async def ask(self, user: str, prompt: list[int] = SECRET, *salt: str) -> tuple[list[int], int]:
        """A fresh context of ``user`` (made with ``salt``) generating after ``prompt``, then destroyed: its tokens
        and the prompt tokens it found cached (by ``user``'s own stats)."""
        before = (await self.call(user, "stats"))["prefix_hit_tokens"]
        ctx = await self.call(user, "create", *salt)
        tokens = await self.generate(user, ctx, prompt)
        await self.call(user, "destroy", ctx)
        return tokens, (await self.call(user, "stats"))["prefix_hit_tokens"] - before

    def stop(self) -> None:
        self.batches.cancel()


def run(runner, body, shared: bool = False):
    async def main():
        replica = Replica(runner, shared)
        try:
            return await body(replica)
        finally:
            replica.stop()

    return asyncio.run(main())


def test_alice_cannot_reuse_bobs_cached_prompt(runner):
    async def body(r: Replica):
        bob_first, bob_cold = await r.ask("bob")
        alice, alice_hits = await r.ask("alice")
        bob_again, bob_hits = await r.ask("bob")
        alice_again, alice_own = await r.ask("alice")
        return bob_first, bob_cold, alice, alice_hits, bob_again, bob_hits, alice_again, alice_own

    bob_first, bob_cold, alice, alice_hits, bob_again, bob_hits, alice_again, alice_own = run(runner, body)
    assert bob_cold == 0
    assert alice_hits == 0, "alice found bob's cached prompt: its pages are keyed by content alone"
    assert bob_hits == CACHED, "bob's repeat of his own prompt finds his pages"
    assert alice_own == CACHED, "alice's repeat finds the pages she wrote herself"
    assert alice == bob_first == bob_again == alice_again, "greedy tokens are the same, computed or reused"


def test_with_share_cluster_alice_finds_bobs_pages(runner):
    async def body(r: Replica):
        bob, _ = await r.ask("bob")
        alice, alice_hits = await r.ask("alice")
        return bob, alice, alice_hits

    bob, alice, alice_hits = run(runner, body, shared=True)
    assert alice_hits == CACHED and alice == bob


def test_stats_over_alices_connection_cover_only_her_own_work(runner):
    async def body(r: Replica):
        await r.ask("alice", PROMPT)
        seen = await r.call("alice", "stats")
        ctx = await r.call("bob", "create")
        await r.generate("bob", ctx, SECRET)
        await r.call("bob", "save", ctx, "bobs-secret")
        await r.ask("bob")
        during = await r.call("alice", "stats")
        replica_wide = await r.engine.stats()  # the trusted side (``pie status``) sees everyone's
        await r.call("bob", "destroy", ctx)
        return seen, during, replica_wide

    seen, during, replica_wide = run(runner, body)
    assert during == seen, "a counter alice reads moved with bob's work"
    assert set(seen) == {"contexts", "snapshots", "suspended", "prefix_hit_tokens"}
    assert replica_wide.snapshots == 1 and replica_wide.contexts == 1
    assert replica_wide.prefix_hit_tokens == CACHED  # bob's repeat


def test_a_cache_salt_narrows_reuse_to_the_same_salt(runner):
    async def body(r: Replica):
        plain, _ = await r.ask("alice")
        salted, salted_cold = await r.ask("alice", SECRET, "tenant-7")
        _, same = await r.ask("alice", SECRET, "tenant-7")
        _, other = await r.ask("alice", SECRET, "tenant-8")
        _, unsalted = await r.ask("alice")
        _, bob_same_salt = await r.ask("bob", SECRET, "tenant-7")
        return plain, salted, salted_cold, same, other, unsalted, bob_same_salt

    plain, salted, salted_cold, same, other, unsalted, bob_same_salt = run(runner, body)
    assert salted_cold == 0, "a salted context does not find the unsalted pages"
    assert same == CACHED and other == 0 and unsalted == CACHED
    assert bob_same_salt == 0, "the same salt does not reach across users"
    assert salted == plain


@pytest.mark.parametrize("salt", [7, "x" * (MAX_CACHE_SALT + 1), ["a"]])
def test_a_malformed_cache_salt_is_refused_by_name(runner, salt):
    async def body(r: Replica):
        with pytest.raises(ValueError, match=f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters"):
            await r.call("alice", "create", salt)
        return await r.engine.stats()

    assert run(runner, body).contexts == 0


def test_forks_and_snapshots_of_the_same_user_share_pages(runner):
    async def body(r: Replica):
        ctx = await r.call("alice", "create", "s")
        await r.forward("alice", ctx, SECRET, 0)
        child = decode(ContextReply, await r.call("alice", "fork", ctx)).ctx
        await r.call("alice", "save", ctx, "kept")
        # another run of alice's (a new session) opens the snapshot: it shares the chain
        r.sessions["alice"] = f"{TRUST.instance('alice')['capability']}/s"
        opened = decode(ContextReply, await r.call("alice", "open", "kept")).ctx
        table = r.engine.contexts
        chains = [table.view(c).page_ids[: CACHED // 16] for c in (ctx, child, opened)]
        _, hits = await r.ask("alice", SECRET, "s")  # the snapshot's pages, under its salt
        _, bob_hits = await r.ask("bob", SECRET, "s")
        return chains, hits, bob_hits

    chains, hits, bob_hits = run(runner, body)
    assert chains[0] == chains[1] == chains[2] and len(chains[0]) == CACHED // 16
    assert hits == CACHED and bob_hits == 0


def test_suspended_and_restored_contexts_keep_their_namespace(runner):
    async def body(r: Replica):
        ctx = await r.call("alice", "create", "s")
        before = await r.generate("alice", ctx, SECRET, 3)
        pages = r.engine.contexts.view(ctx).page_ids[: CACHED // 16]
        await r.call("alice", "suspend", ctx)
        after = await r.generate("alice", ctx, [before[-1]], 2)  # restored: adopts its own cached pages again
        restored_pages = r.engine.contexts.view(ctx).page_ids[: CACHED // 16]
        # after a failover, a context rebuilt from its mirrored lineage and salt lands its pages where they were
        tokens = r.engine.contexts.tokens(ctx)
        made = decode(ContextReply, await r.call("alice", "restore", tokens, list(range(len(tokens))), None, 0.0, "s"))
        await r.generate("alice", made.ctx, [after[-1]], 1)
        moved_pages = r.engine.contexts.view(made.ctx).page_ids[: CACHED // 16]
        return before, after, pages, restored_pages, moved_pages

    before, after, pages, restored_pages, moved_pages = run(runner, body)
    assert restored_pages == pages == moved_pages
    assert len(before) == 3 and len(after) == 2


def test_a_forks_mirror_keeps_the_salt_that_a_failover_restores_it_with():
    """The SDK's copy of a context's lineage (what ``restore`` sends after a failover) carries its salt to forks."""
    child = Lineage([1, 2], [0, 1], cache_salt="s").child(3, [3], [2])
    assert child.cache_salt == "s" and child.tokens == [1, 2, 3]
