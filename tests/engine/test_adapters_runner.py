"""LoRA adapters and zo seeds in the model runner, against PEFT on transformers: a zero adapter changes nothing, a
random one matches PEFT, adapters saved here load in PEFT, a mixed batch gives each request its own adapter, zo
seeds are deterministic and mirrored, and bad requests, oversized files and paths out of the user's directory are
refused. Adapters through the SDK on a served replica are in ``test_adapters_replica.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import PeftModel
from peft_refs import hf_model, peft_adapter, tokens_of
from pie_workers.adapters import LoraAdapter, LoraConfig, perturbed
from pie_workers.layers.lora import PEFT_MODULES, module_shapes
from pie_workers.peft_format import read_adapter, user_path, write_adapter
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.wire.batch import ForwardBatch
from support.paged import LOGITS, PageAllocator, Seq, request_for

PAGES = 128


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(tiny_llama, RunnerSettings(num_pages=PAGES))


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
