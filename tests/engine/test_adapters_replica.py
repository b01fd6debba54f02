"""LoRA adapters and zo seeds through the SDK on a served replica (every test on the torch and the vllm backend):
an adapter's lifecycle, generation and errors, a PEFT adapter loaded and matching PEFT, the KV cache under adapters
and zo seeds shared only where it is the same, and tensor-parallel adapters matching a single rank. The runner
against PEFT directly is in ``test_adapters_runner.py``.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from inferlet import Adapter, Context, Logits, Model, Sampler
from peft_refs import peft_adapter, tokens_of
from pie_workers.peft_format import default_root, read_adapter
from pie_workers.runner import RunnerSettings
from support.sdk_host import TRUST, each_backend

served = each_backend()  # every test here runs on the torch and the vllm backend


def adapter_root(replica) -> Path:
    """Where a replica keeps adapters: under its own node's cache (the test cluster's nodes have different ones,
    both reachable from this machine)."""
    return Path(ray.get(replica.leader.__ray_call__.remote(lambda worker: str(default_root()))))


@pytest.fixture(scope="module")
def replica_root(served) -> Path:
    return adapter_root(served.replica)


@pytest.fixture
def user(replica_root):
    """A user of its own (adapters are per user), whose adapter directory is removed afterwards."""
    name = f"adapter-test-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(replica_root / name, ignore_errors=True)


async def probe_last(model: Model, tokens: list[int], adapter=None, zo_seed=None) -> np.ndarray:
    """Logits at the last of ``tokens``, run in a fresh context (released after)."""
    with Context(model) as ctx:
        fwd = ctx.forward()
        fwd.input(tokens)
        if adapter is not None:
            fwd.adapter(adapter)
        if zo_seed is not None:
            fwd.zo_seed(zo_seed)
        h = fwd.probe(len(tokens) - 1, Logits())
        return np.frombuffer((await fwd.execute()).logits(h), np.float32)


def test_sdk_adapter_lifecycle_generation_and_errors(served, user, replica_root):
    async def main(input):
        model = Model.load("default")
        results, errors = {}, {}
        with Adapter.create(model, "fresh", rank=4, alpha=8, target_modules=["q_proj", "up_proj"], sigma=1.0) as a:
            assert (a.rank, a.alpha, a.target_modules) == (4, 8, ["q_proj", "up_proj"])
            for key, options in {
                "base": {},
                "fresh": {"adapter": a},
                "zo": {"adapter": a, "zo_seed": 5},
                "zo-again": {"adapter": a, "zo_seed": 5},
            }.items():
                with Context(model) as ctx:
                    ctx.user("Tell me about rivers and seven blue tokens.")
                    results[key] = await ctx.generate(Sampler.argmax(), max_tokens=8, **options).collect_tokens()
            with Context(model) as ctx:
                ctx.user("Tell me about rivers and seven blue tokens.")
                g = ctx.generate(Sampler.argmax(), max_tokens=8).adapter(a).zo_seed(5)
                results["builder"] = await g.collect_tokens()
            assert Adapter.open(model, "fresh").rank == 4
            child = a.fork("child")
            child.save("saved/child")
            for name, action in {
                "duplicate": lambda: Adapter.create(model, "fresh"),
                "traversal": lambda: a.load("../other-user/x"),
                "missing": lambda: a.load("never-saved"),
                "targets": lambda: Adapter.create(model, "bad", target_modules=["lm_head"]),
                "rank": lambda: Adapter.create(model, "bad", rank=0),
            }.items():
                try:
                    action()
                except ValueError as e:
                    errors[name] = str(e)
            with Context(model) as ctx:
                fwd = ctx.forward()
                fwd.input([5, 6, 7])
                fwd.zo_seed(3)
                try:
                    await fwd.execute()
                except ValueError as e:
                    errors["zo-alone"] = str(e)
            reloaded = Adapter.create(model, "reloaded", rank=2)
            reloaded.load("saved/child")
            results["reloaded"] = (reloaded.rank, reloaded.target_modules)
            child.destroy()
            try:
                child.save()
            except ValueError as e:
                errors["destroyed"] = str(e)
            reloaded.destroy()
        results["after-with"] = Adapter.open(model, "fresh")
        return results, errors

    results, errors = served.run(main, user=user)
    assert results["fresh"] == results["base"], "a new adapter (B = 0) changes nothing"
    assert results["zo"] == results["zo-again"] == results["builder"]
    assert results["zo"] != results["base"]
    assert results["reloaded"] == (4, ["q_proj", "up_proj"])
    assert results["after-with"] is None, "leaving the with block drops the adapter"
    assert "already exists" in errors["duplicate"]
    assert "inside your adapter directory" in errors["traversal"]
    assert "no adapter directory 'never-saved'" in errors["missing"]
    assert "target modules" in errors["targets"] and "positive integer" in errors["rank"]
    assert "zo_seed perturbs an adapter" in errors["zo-alone"]
    assert "destroyed" in errors["destroyed"]
    assert (replica_root / user / "saved" / "child" / "adapter_model.safetensors").is_file()
    stats = served.stats()
    assert stats.working == 0 and stats.contexts == 0


def test_sdk_loads_a_peft_adapter_and_matches_peft(served, tiny_llama, user, replica_root):
    reference = peft_adapter(tiny_llama, replica_root / user / "trained", rank=4, seed=3)
    prompt = tokens_of(20, 8)

    async def main(input):
        model = Model.load("default")
        adapter = Adapter.create(model, "trained")
        adapter.load("trained")
        return await probe_last(model, prompt, adapter)

    got = served.run(main, user=user)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert read_adapter(replica_root / user / "trained")[0].rank == 4


def test_kv_under_a_zo_seed_is_never_shared_and_adapters_share_only_with_themselves(served, user):
    prompt = tokens_of(48, 99)  # three full pages

    async def main(input):
        model = Model.load("default")
        adapter = Adapter.create(model, "a", sigma=0.5)
        fresh_pages, logits = {}, {}
        for key, options in [
            ("base", {}),
            ("base-again", {}),
            ("adapter", {"adapter": adapter}),
            ("adapter-again", {"adapter": adapter}),
            ("zo", {"adapter": adapter, "zo_seed": 4}),
            ("zo-again", {"adapter": adapter, "zo_seed": 4}),
        ]:
            before = await served.replica.leader.engine_stats.remote()
            with Context(model) as ctx:
                fwd = ctx.forward()
                fwd.input(prompt)
                if options:
                    fwd.adapter(options["adapter"])
                if "zo_seed" in options:
                    fwd.zo_seed(options["zo_seed"])
                h = fwd.probe(len(prompt) - 1, Logits())
                logits[key] = np.frombuffer((await fwd.execute()).logits(h), np.float32)
                after = await served.replica.leader.engine_stats.remote()
                fresh_pages[key] = before.free - after.free
        adapter.destroy()
        return fresh_pages, logits

    fresh, logits = served.run(main, user=user)
    # a pass whose KV may be shared adopts the two cached pages and dedups its third into the cached copy
    assert fresh == {"base": 3, "base-again": 0, "adapter": 3, "adapter-again": 0, "zo": 3, "zo-again": 3}
    np.testing.assert_array_equal(logits["base"], logits["base-again"])
    np.testing.assert_allclose(logits["adapter"], logits["base"], atol=1e-5)
    np.testing.assert_array_equal(logits["zo"], logits["zo-again"])
    assert np.abs(logits["zo"] - logits["adapter"]).max() > 1e-3


def test_tensor_parallel_adapters_match_single_rank(served, tiny_llama, user, replica_root):
    from pie_cluster.hosts.run import endpoints_for, run_inferlet
    from pie_workers.engine.scheduler import BatchLimits
    from pie_workers.replica import Replica

    prompt = tokens_of(25, 5)

    async def main(input):
        out = {}
        for name in ("default", "tp"):
            model = Model.load(name)
            adapter = Adapter.create(model, "trained", sigma=0.3)
            adapter.load("trained")
            out[name] = [await probe_last(model, prompt, adapter, seed) for seed in (None, 11, -11)]
            adapter.destroy()
        return out

    replica = Replica(tiny_llama, 2, RunnerSettings(num_pages=64), engine=BatchLimits(), secret=TRUST.secret)
    roots = {replica_root, adapter_root(replica)}
    try:
        for root in roots:  # the same adapter on each replica's node
            peft_adapter(tiny_llama, root / user / "trained", rank=4, seed=4)
        endpoints = served.endpoints | endpoints_for("tp", replica)
        out = asyncio.run(run_inferlet(main, {}, endpoints, user, **TRUST.instance(user)))
    finally:
        replica.shutdown()
        for root in roots:
            shutil.rmtree(root / user, ignore_errors=True)
    for single, tp in zip(out["default"], out["tp"], strict=True):
        np.testing.assert_allclose(tp, single, atol=1e-4, rtol=0)
    assert np.abs(out["default"][1] - out["default"][2]).max() > 1e-3, "mirrored seeds perturb differently"
