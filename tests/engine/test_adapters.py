"""LoRA adapters and zo seeds: the runner against PEFT on transformers, mixed batches, PEFT files both ways, the SDK
end to end (lifecycle, errors, prefix sharing under adapters and zo seeds), and tensor parallelism.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from inferlet import Adapter, Context, Logits, Model, Sampler
from paged import LOGITS, PageAllocator, Seq, request_for
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from pie_workers.adapters import LoraAdapter, LoraConfig, perturbed
from pie_workers.layers.lora import PEFT_MODULES, module_shapes
from pie_workers.peft_format import default_root, read_adapter, user_path, write_adapter
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch
from sdk_host import TRUST, each_backend
from transformers import AutoModelForCausalLM

served = each_backend()  # every test here runs on the torch and the vllm backend

PAGES = 128


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES))


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_adapter(model_dir, out_dir, targets=PEFT_MODULES, rank=4, alpha=8, seed=0, rslora=False) -> PeftModel:
    """A PEFT adapter with every matrix random (B too), saved to ``out_dir``; returns the PEFT model."""
    torch.manual_seed(seed)
    config = PeftLoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, use_rslora=rslora
    )
    model = get_peft_model(hf_model(model_dir), config).eval()
    model.save_pretrained(out_dir)
    return model


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def all_logits(runner, prompts, adapters=None, seeds=None) -> list[np.ndarray]:
    """Prefill every prompt in one batch, then one greedy decode step; per request, the logits of every row of
    both passes."""
    n = len(prompts)
    adapters, seeds = adapters or [None] * n, seeds or [None] * n
    alloc = PageAllocator(PAGES)
    seqs = [Seq(list(p)) for p in prompts]

    def step() -> list[np.ndarray]:
        reqs = [
            request_for(
                s, alloc, runner.page_size, [(i, LOGITS) for i in range(len(s.pending()))], adapter=a, zo_seed=z
            )
            for s, a, z in zip(seqs, adapters, seeds, strict=True)
        ]
        outs = runner.execute(ForwardBatch(reqs))
        rows = []
        for s, r, o in zip(seqs, reqs, outs, strict=True):
            assert o.error is None, o.error
            s.kv_len += len(r.token_ids)
            rows.append(np.stack([np.frombuffer(x.logits, np.float32) for x in o.slots]))
        return rows

    prefill = step()
    for s, rows in zip(seqs, prefill, strict=True):
        s.tokens.append(int(rows[-1].argmax()))
    return [np.concatenate([p, d]) for p, d in zip(prefill, step(), strict=True)]


def peft_logits(model, tokens: list[int], continuation: int) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens + [continuation]])).logits[0].numpy()


def test_zero_b_adapter_leaves_logits_unchanged(runner):
    runner.create_adapter(101, LoraConfig(4, 8.0, PEFT_MODULES), sigma=0.0)
    try:
        prompts = [tokens_of(21, 1), tokens_of(5, 2)]
        base = all_logits(runner, prompts)
        fresh = all_logits(runner, prompts, adapters=[101, 101])
        for b, f in zip(base, fresh, strict=True):
            np.testing.assert_array_equal(b, f)
    finally:
        runner.drop_adapter(101)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_adapter_matches_peft(arch, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}")
    runner = ModelRunner(model_dir, RunnerSettings(num_pages=PAGES))
    reference = peft_adapter(model_dir, tmp_path, rank=4, alpha=8, rslora=arch == "qwen3")
    runner.create_adapter(1, LoraConfig(8, 16.0), sigma=0.0)
    config, weights = read_adapter(tmp_path)
    assert (config.rank, config.targets, config.rslora) == (4, PEFT_MODULES, arch == "qwen3")
    runner.replace_adapter(1, config, weights)
    prompt = tokens_of(37, 3)
    got = all_logits(runner, [prompt], adapters=[1])[0]
    expected = peft_logits(reference, prompt, int(got[len(prompt) - 1].argmax()))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    with reference.disable_adapter(), torch.no_grad():
        base = reference(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(base - expected[: len(prompt)]).max() > 0.1, "the adapter must matter for the test to mean much"


def test_adapter_saved_here_loads_in_peft(runner, tiny_llama, tmp_path):
    config = LoraConfig(3, 6.0, ("k_proj", "o_proj", "up_proj"))
    gen = torch.Generator().manual_seed(5)
    weights = {}
    shapes = module_shapes(runner.cfg)
    for layer in range(runner.cfg.num_layers):
        for module in config.targets:
            fan_in, fan_out = shapes[module]
            weights[layer, module] = (torch.randn(3, fan_in, generator=gen), torch.randn(fan_out, 3, generator=gen))
    runner.adapters.put(102, LoraAdapter(config, weights))
    try:
        write_adapter(runner.adapters.get(102), tmp_path / "mine", str(tiny_llama))
        reference = PeftModel.from_pretrained(hf_model(tiny_llama), tmp_path / "mine").eval()
        prompt = tokens_of(19, 4)
        got = all_logits(runner, [prompt], adapters=[102])[0]
        np.testing.assert_allclose(got, peft_logits(reference, prompt, int(got[18].argmax())), atol=1e-4, rtol=0)
    finally:
        runner.drop_adapter(102)


def test_mixed_batch_gives_each_request_its_own_adapter(runner, tiny_llama, tmp_path):
    peft_adapter(tiny_llama, tmp_path / "one", rank=4, seed=1)
    peft_adapter(tiny_llama, tmp_path / "two", ("q_proj", "v_proj"), rank=2, alpha=4, seed=2)
    for adapter_id, name in ((1, "one"), (2, "two")):
        runner.create_adapter(adapter_id, LoraConfig(8, 16.0), sigma=0.5)
        runner.replace_adapter(adapter_id, *read_adapter(tmp_path / name))
    zo = LoraAdapter(runner.adapters.get(1).config, perturbed(runner.adapters.get(1), 7))
    runner.adapters.put(103, zo)
    write_adapter(runner.adapters.get(103), tmp_path / "one-zo-7", str(tiny_llama))
    runner.drop_adapter(103)

    prompts = [tokens_of(n, 10 + n) for n in (5, 9, 17, 3, 12)]
    adapters, seeds = [1, None, 2, 1, 1], [None, None, None, 7, None]
    mixed = all_logits(runner, prompts, adapters, seeds)
    plain = all_logits(runner, prompts)
    np.testing.assert_array_equal(mixed[1], plain[1])  # without an adapter: exactly the base result

    reference = PeftModel.from_pretrained(hf_model(tiny_llama), tmp_path / "one", adapter_name="one").eval()
    reference.load_adapter(tmp_path / "two", adapter_name="two")
    reference.load_adapter(tmp_path / "one-zo-7", adapter_name="one-zo-7")
    names = ["one", None, "two", "one-zo-7", "one"]
    for prompt, got, name in zip(prompts, mixed, names, strict=True):
        continuation = int(got[len(prompt) - 1].argmax())
        if name is None:
            with reference.disable_adapter():
                expected = peft_logits(reference, prompt, continuation)
        else:
            reference.set_adapter(name)
            expected = peft_logits(reference, prompt, continuation)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=str(name))
    runner.drop_adapter(1)
    runner.drop_adapter(2)


def test_zo_seed_is_deterministic_mirrored_and_perturbs_a_fresh_adapter(runner):
    runner.create_adapter(104, LoraConfig(4, 8.0, ("q_proj", "down_proj")), sigma=0.2)
    try:
        adapter = runner.adapters.get(104)
        up, down = perturbed(adapter, 12), perturbed(adapter, -12)
        for key, (a, b) in adapter.weights.items():
            torch.testing.assert_close(up[key][0] - a, a - down[key][0], rtol=0, atol=1e-6)
            torch.testing.assert_close(up[key][1] - b, b - down[key][1], rtol=0, atol=1e-6)
        prompt = [tokens_of(11, 6)]
        base = all_logits(runner, prompt, [104])[0]
        first, again, other = (all_logits(runner, prompt, [104], [s])[0] for s in (12, 12, 13))
        np.testing.assert_array_equal(first, again)
        assert np.abs(first - base).max() > 1e-3 and np.abs(first - other).max() > 1e-3
    finally:
        runner.drop_adapter(104)


def test_bad_adapter_requests_fail_alone(runner):
    prompt = tokens_of(6, 7)
    alloc = PageAllocator(PAGES, 9)
    reqs = [
        request_for(Seq(list(prompt)), alloc, 16, adapter=999),
        request_for(Seq(list(prompt)), alloc, 16, zo_seed=3),
        request_for(Seq(list(prompt)), alloc, 16),
    ]
    outs = runner.execute(ForwardBatch(reqs))
    assert "adapter 999 does not exist" in outs[0].error
    assert "zo seed perturbs an adapter" in outs[1].error
    assert outs[2].error is None and outs[2].slots[0].token is not None


def load_into(runner, adapter_id: int, directory) -> None:
    runner.replace_adapter(adapter_id, *read_adapter(directory))


def test_files_that_do_not_fit_are_refused(runner, tiny_llama, tiny_qwen3, tmp_path):
    runner.create_adapter(105, LoraConfig(2, 4.0), sigma=0.0)
    try:
        peft_adapter(tiny_qwen3, tmp_path / "qwen", ("q_proj",))  # q_proj is 128 -> 256 in qwen3, 128 -> 128 here
        with pytest.raises(ValueError, match=r"layer 0 q_proj: lora_A \(4, 128\) / lora_B \(256, 4\) do not match"):
            load_into(runner, 105, tmp_path / "qwen")
        peft_adapter(tiny_llama, tmp_path / "dora", ("v_proj",))
        config = (
            (tmp_path / "dora" / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
        )
        (tmp_path / "dora" / "adapter_config.json").write_text(config)
        with pytest.raises(ValueError, match="DoRA is not supported"):
            load_into(runner, 105, tmp_path / "dora")
        peft_adapter(tiny_llama, tmp_path / "head", ("lm_head",))
        with pytest.raises(ValueError, match="lm_head"):
            load_into(runner, 105, tmp_path / "head")
        with pytest.raises(ValueError, match="adapter_config.json is missing"):
            load_into(runner, 105, tmp_path)
        assert runner.adapters.get(105).config.rank == 2, "a refused load leaves the adapter as it was"
        with pytest.raises(ValueError, match="target modules"):
            runner.create_adapter(106, LoraConfig(2, 4.0, ("embed_tokens",)), sigma=0.0)
        with pytest.raises(ValueError, match="rank must be a positive integer"):
            LoraConfig(0, 4.0)
    finally:
        runner.drop_adapter(105)


def test_adapter_paths_stay_in_the_users_directory(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "link").symlink_to(tmp_path / "elsewhere")
    assert user_path(tmp_path, "alice", "runs/a") == (tmp_path / "alice" / "runs" / "a").resolve()
    for bad in ("../bob/a", "/etc", "a/../../b", "", ".", "a\\..\\b", "link/x"):
        with pytest.raises(ValueError):
            user_path(tmp_path, "alice", bad)
    with pytest.raises(ValueError, match="user name"):
        user_path(tmp_path, "..", "a")


# -- through the SDK, on a served replica ------------------------------------------------------------------------


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
    assert stats["working"] == 0 and stats["contexts"] == 0


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
                fresh_pages[key] = before["free"] - after["free"]
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
    from pie_cluster.host import endpoints_for, run_inferlet
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
