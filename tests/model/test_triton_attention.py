"""The Triton paged-attention kernel (``layers.triton_attention``) and its pool against the torch path.

No GPU here, so the kernel runs under Triton's interpreter, on CPU tensors. ``triton.jit`` picks the interpreter when
it wraps a function, and triton's own library (``tl.zeros``, ``tl.max``) is wrapped when triton is first imported:
``TRITON_INTERPRET=1`` must be set before that import, and from then on holds for every kernel of the process
(vLLM's, on a GPU host, too). So the checks run in one child process started with it — this file run as a script —
and each test asserts on what the child measured; the rest of the session never sees the interpreter. Where CUDA is,
``gpu``-marked tests run the compiled kernel here, in bf16 and float32.

Each case writes one ragged batch's K/V through both pools' ``write`` (pages in random order) and compares their
``attend``: the torch pool's SDPA over padded buckets, the Triton pool's kernel over block tables.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from pie_workers.batch_plan import PagedRequests, plan_batch
from pie_workers.kv_pool import KVPool, PoolShape
from pie_workers.wire import brle
from pie_workers.wire.batch import ForwardBatch, ForwardRequest
from pie_workers.wire.pages import pages_for
from support.triton_child import interpreted_run

HEAD_DIM = 32
DECODE = ((45, 1), (100, 1), (7, 1), (0, 1), (16, 1))  # (tokens already in the KV, new rows) per request
PREFILL = ((0, 37), (0, 5), (0, 20), (0, 1))
CHUNKED = ((45, 1), (100, 5), (7, 1), (0, 37), (63, 20))  # decode, chunks over a cached prefix and a prefill mixed


@dataclass(frozen=True)
class Case:
    shapes: tuple[tuple[int, int], ...]
    heads: tuple[int, int] = (8, 2)  # query heads, KV heads
    page_size: int = 16
    window: int | None = None
    masked: int | None = None  # the request given a custom attention mask
    empty_request: bool = False  # the kernel also gets a request with KV but no rows (plan_batch rejects those)


CASES = {
    "decode": Case(DECODE),
    "prefill": Case(PREFILL),
    "chunked prefill": Case(CHUNKED),
    "MHA, pages of 5 tokens": Case(CHUNKED, heads=(4, 4), page_size=5),
    "groups of 3 query heads": Case(CHUNKED, heads=(6, 2)),
    "sliding window": Case(CHUNKED, window=24),
    "custom mask": Case(CHUNKED, masked=1),
    "custom mask, sliding window": Case(CHUNKED, window=24, masked=3),
    "empty request": Case(DECODE, empty_request=True),
}


def max_error(case: Case, device: torch.device, dtype: torch.dtype) -> float:
    """The largest difference between the Triton pool's and the torch pool's attention on the case's batch."""
    from pie_workers.triton_kv_pool import TritonKVPool  # imports triton: only where the kernel runs

    rng, gen = random.Random(len(case.shapes)), torch.Generator().manual_seed(case.page_size)
    heads_q, heads_kv = case.heads
    needed = [pages_for(kv + rows, case.page_size) for kv, rows in case.shapes]
    num_pages = sum(needed) + 3
    shuffled = rng.sample(range(num_pages), num_pages)
    page_lists = [shuffled[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(case.shapes))]
    requests = [
        ForwardRequest(token_ids=[1] * n, positions=list(range(kv, kv + n)), page_ids=pages, kv_len=kv)
        for (kv, n), pages in zip(case.shapes, page_lists, strict=True)
    ]
    if case.masked is not None:  # each row sees every other slot of its causal prefix, and itself
        kv, n = case.shapes[case.masked]
        requests[case.masked].attention_masks = [
            brle.encode([s % 2 == 0 or s == kv + i for s in range(kv + i + 1)]) for i in range(n)
        ]
    slots = torch.tensor(
        [pages[i // case.page_size] * case.page_size + i % case.page_size
         for (kv, rows), pages in zip(case.shapes, page_lists, strict=True) for i in range(kv + rows)],
        device=device,
    )  # fmt: skip
    k, v = torch.randn(2, slots.numel(), heads_kv, HEAD_DIM, generator=gen).to(device, dtype)
    q = torch.randn(sum(rows for _, rows in case.shapes), heads_q, HEAD_DIM, generator=gen).to(device, dtype)
    cfg = SimpleNamespace(num_layers=1, head_dim=HEAD_DIM)
    outs = []
    for pool in (KVPool, TritonKVPool):
        kv_pool = pool(PoolShape(cfg, num_pages, case.page_size, heads_kv, dtype, device))
        kv_pool.write(0, slots, k, v)
        plan = plan_batch(
            ForwardBatch(requests), case.page_size, num_pages, 16,
            paged_requests=pool.needs_paged_requests, kernel_attends_all=pool.kernel_attends_all,
        ).plan.to(device)  # fmt: skip
        if case.empty_request and pool is TritonKVPool:
            plan.paged = with_empty_request(plan.paged, at=2, seq_len=30)
        outs.append(kv_pool.attend(0, q, plan, case.window, HEAD_DIM**-0.5))
    return (outs[1].float() - outs[0].float()).abs().max().item()


def with_empty_request(paged: PagedRequests, at: int, seq_len: int) -> PagedRequests:
    """``paged`` with a request of ``seq_len`` keys (the pages of request 0) and no rows inserted before ``at``."""
    insert = lambda t, row: torch.cat([t[:at], row, t[at:]])
    return dataclasses.replace(
        paged,
        query_start=insert(paged.query_start, paged.query_start[at : at + 1]),
        seq_lens=insert(paged.seq_lens, paged.seq_lens.new_tensor([seq_len])),
        block_table=insert(paged.block_table, paged.block_table[:1]),
        has_empty_request=True,
    )


def greedy_through_both_pools(model_dir: str) -> dict:
    """The tiny Llama's logits over a prompt and its greedy tokens after it, with the torch pool and then with the
    Triton pool in its place (the runner picks the Triton pool on a GPU only)."""
    from pie_workers.runner import ModelRunner, RunnerSettings
    from pie_workers.triton_kv_pool import TritonKVPool
    from support.paged import LOGITS, PageAllocator, Seq, greedy_generate, request_for

    runner = ModelRunner(model_dir, RunnerSettings(num_pages=16, device="cpu", backend="torch"))
    shape = PoolShape(runner.cfg, 16, runner.page_size, runner.cfg.num_kv_heads, runner.dtype, runner.device)
    prompt = [random.Random(3).randrange(runner.cfg.vocab_size) for _ in range(21)]
    result = {}
    for pool in (KVPool, TritonKVPool):
        runner.kv = pool(shape)
        request = request_for(Seq(prompt), PageAllocator(16), 16, [(i, LOGITS) for i in range(len(prompt))])
        slots = runner.execute(ForwardBatch([request]))[0].slots
        logits = torch.stack([torch.frombuffer(bytearray(s.logits), dtype=torch.float32) for s in slots])
        result[pool.__name__] = {"logits": logits, "tokens": greedy_generate(runner, prompt, 12, PageAllocator(16))}
    torch_pool, triton_pool = result["KVPool"], result["TritonKVPool"]
    return {
        "torch tokens": torch_pool["tokens"],
        "triton tokens": triton_pool["tokens"],
        "logit error": (triton_pool["logits"] - torch_pool["logits"]).abs().max().item(),
    }


@pytest.fixture(scope="module")
def interpreted(tiny_llama) -> dict:
    """What the child process under Triton's interpreter measured: every case's error, and the tiny Llama's run."""
    return interpreted_run(__file__, str(tiny_llama))


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_attends_as_the_torch_path(interpreted, name):
    """float32: the two sum in different orders, ~5e-7 apart; custom-masked rows are the torch path's own."""
    assert interpreted[name] <= 1e-5


def test_the_tiny_llama_decodes_the_same_greedy_tokens_through_the_triton_pool(interpreted):
    run = interpreted["tiny llama"]
    assert run["triton tokens"] == run["torch tokens"]
    assert run["logit error"] <= 1e-4


@pytest.mark.parametrize("dtype,block_m,group,head_dim", [("bf16", 64, 3, 64), ("fp32", 16, 4, 64)])
def test_the_kernel_compiles_for_a_hopper_gpu(dtype, block_m, group, head_dim):
    """What the interpreter does not check (types carried through the loop, the early return, the dots' operand
    types and precision), checked without a GPU: triton's own compiler and ptxas build the kernel for sm_90, in the
    decode and the prefill tile, in bf16 and in float32. In this process: compiling needs no interpreter."""
    import triton
    from pie_workers.layers.triton_attention import BLOCK_N, _paged_attention_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = {
        "GROUP": group, "HEAD_DIM": head_dim, "HEAD_DIM_PADDED": head_dim, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else None,
    }  # fmt: skip
    tables = ("query_start_ptr", "seq_lens_ptr", "block_table_ptr")
    signature = {
        name: "constexpr" if name in constants else "*i32" if name in tables else f"*{dtype}"
        if name.endswith("_ptr") else "fp32" if name == "scale_log2" else "i32"
        for name in _paged_attention_kernel.arg_names
    }  # fmt: skip
    source = ASTSource(_paged_attention_kernel, signature, constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel cannot run here")
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compiled_kernel_attends_as_sdpa_on_a_gpu(name, dtype):
    """The kernel compiled for the GPU against SDPA over padded buckets: within bf16 rounding (2^-8 of values below
    1, a few times over) in bf16, within float32 noise in float32 (the kernel's dots in IEEE float32, not TF32)."""
    assert max_error(CASES[name], torch.device("cuda"), dtype) < (2e-2 if dtype == torch.bfloat16 else 2e-5)


if __name__ == "__main__":  # the child of ``interpreted``: TRITON_INTERPRET=1 is set before triton is imported
    cpu = torch.device("cpu")
    measured = {name: max_error(case, cpu, torch.float32) for name, case in CASES.items()}
    measured["tiny llama"] = greedy_through_both_pools(sys.argv[1])
    print(json.dumps(measured))
