"""The KV pools' write and paged decode attention as custom ops, so a compiled decode step holds them as single nodes
instead of breaking its graph around them (``compiled_step``).

Each op takes a pool's whole cache tensor and a layer index: the write declares the cache mutated, the attention reads
it, so the compiler keeps every layer's write before its attention. Rows of the padded batch beyond the real ones are
never written (the torch pool's write stops at ``rows``, vLLM's kernel skips negative slots); they attend one slot of
page 0 and their outputs are discarded.

They are registered through ``torch.library.Library`` rather than ``torch.library.custom_op``, whose per-call checks
cost ~12 µs against ~2 µs here (measured on this 2-core CPU): a step calls two of them per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pie_workers.layers.vllm_ops import kernels

_lib = torch.library.Library("pie", "DEF")


def _op(schema: str, fake):
    """Define ``pie::<schema>``: the decorated function is its kernel (any device), ``fake`` its shape function."""

    def register(kernel):
        name = schema.split("(")[0]
        _lib.define(schema)
        _lib.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"pie::{name}", fake, lib=_lib)
        return kernel

    return register


def _no_output(*args) -> None:
    return None


def _rows_of_q(q: torch.Tensor, *args) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@_op(
    "torch_kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor slots, Tensor k, Tensor v, "
    "Tensor rows) -> ()",
    _no_output,
)
def torch_kv_write(k_cache, v_cache, layer: int, slots, k, v, rows) -> None:
    """``KVPool.write`` for the first ``rows`` (a 0-d tensor, so that the graph does not specialise on it) tokens."""
    n = int(rows)
    k_cache[layer].flatten(0, 1).index_copy_(0, slots[:n], k[:n])
    v_cache[layer].flatten(0, 1).index_copy_(0, slots[:n], v[:n])


@_op(
    "torch_paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, int layer, Tensor block_table, Tensor mask, "
    "float scale) -> Tensor",
    _rows_of_q,
)
def torch_paged_decode(q, k_cache, v_cache, layer: int, block_table, mask, scale: float) -> torch.Tensor:
    """One query row per request ``[B, Hq, D]`` over its pages ``block_table`` ``[B, P]``, under the additive
    ``mask`` ``[B, 1, 1, P * page_size]``: the torch path's decode bucket (whole pages gathered, SDPA's own GQA)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[3]
    pages = block_table.flatten()
    keys = k_cache[layer].index_select(0, pages).view(batch, -1, kv_heads, dim).transpose(1, 2)
    values = v_cache[layer].index_select(0, pages).view(batch, -1, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.reshape(batch, heads * dim)


@_op("vllm_kv_write(Tensor(a!) cache, int layer, Tensor slots, Tensor k, Tensor v, str isa) -> ()", _no_output)
def vllm_kv_write(cache, layer: int, slots, k, v, isa: str) -> None:
    """``VllmCpuKVPool.write`` by the kernel, which skips negative slots."""
    keys, values = cache[layer].chunk(2, dim=2)
    kernels().cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), keys, values, slots, isa)


@_op(
    "vllm_paged_decode(Tensor q, Tensor cache, int layer, Tensor query_start, Tensor seq_lens, Tensor block_table, "
    "Tensor metadata, float scale, int window) -> Tensor",
    _rows_of_q,
)
def vllm_paged_decode(q, cache, layer: int, query_start, seq_lens, block_table, metadata, scale: float, window: int):
    """``VllmCpuKVPool.attend``'s kernel call; ``metadata``: its work split, computed once per step and window."""
    keys, values = cache[layer].chunk(2, dim=2)
    out = torch.empty_like(q)
    kernels().cpu_attention_with_kv_cache(
        q.contiguous(), keys, values, out, query_start, seq_lens, scale, True, None, window, block_table, 0.0,
        metadata, None, None,
    )  # fmt: skip
    return out.view(q.shape[0], -1)


@_op(
    "packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    lambda x, w, b: x.new_empty(*x.shape[:-1], w.shape[0]),
)
def packed_linear(x, weight, bias) -> torch.Tensor:
    """``TorchPackedLinear`` as one opaque node: inductor lowers torch's packed matmul only over weights it froze."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
