"""Decode throughput of the paged runner vs transformers' own batched forward, on the same weights.

Usage: python bench/forward.py [--model DIR] [--batches 1,8,32,64] [--steps 64] [--prompt 32] [--repeats 5]
                               [--out docs/bench]

Both sides decode greedily from equal-length random prompts (no padding); HF uses its DynamicCache. Prints
tokens/s for each batch size and the ratio paged / HF, and writes the table to ``OUT/forward.md`` and a plot to
``OUT/forward.png`` (see bench/report.py). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.tiny_model import default_model_path
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot
from pie_workers.wire.pages import pages_for
from report import add_out_option, bar_plot, write_markdown
from rich.console import Console
from rich.table import Table


def paged_decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> float:
    """Tokens/s of ``steps`` batched greedy decode steps after one prefill of every prompt."""
    S = runner.page_size
    n_pages = pages_for(len(prompts[0]) + steps + 1, S)
    pages = [list(range(i * n_pages, (i + 1) * n_pages)) for i in range(len(prompts))]
    kv = [0] * len(prompts)
    pending = [list(p) for p in prompts]

    def step() -> None:
        reqs = [
            ForwardRequest(t, list(range(kv[i], kv[i] + len(t))), pages[i], kv[i], [(len(t) - 1, Slot.argmax())])
            for i, t in enumerate(pending)
        ]
        outs = runner.execute(ForwardBatch(reqs))
        for i, o in enumerate(outs):
            if o.error:
                raise RuntimeError(o.error)
            kv[i] += len(pending[i])
            pending[i] = [o.slots[0].token]

    step()  # prefill, untimed
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return len(prompts) * steps / (time.perf_counter() - start)


def hf_decode(model, prompts: list[list[int]], steps: int) -> float:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        out = model(torch.tensor(prompts), past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        return len(prompts) * steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded tiny Llama)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="best of N runs per cell")
    add_out_option(ap)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    model_dir = args.model or default_model_path("llama")
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = pages_for(args.prompt + args.steps + 1, 16)
    runner = ModelRunner(model_dir, RunnerSettings(num_pages=per_seq * max(batches)))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)

    table = Table(
        title=f"decode tokens/s — {Path(model_dir).name} — {torch.get_num_threads()} threads, "
        f"prompt {args.prompt}, {args.steps} steps"
    )
    for col in ("batch", "paged runner", "transformers", "ratio"):
        table.add_column(col, justify="right")
    paged, reference = [], []
    for b in batches:
        prompts = [[rng.randrange(3, runner.cfg.vocab_size) for _ in range(args.prompt)] for _ in range(b)]
        ours, theirs = 0.0, 0.0
        for _ in range(args.repeats):  # interleaved, best of N: both sides see the same machine noise
            ours = max(ours, paged_decode(runner, prompts, args.steps))
            theirs = max(theirs, hf_decode(hf, prompts, args.steps))
        table.add_row(str(b), f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}")
        paged.append(ours)
        reference.append(theirs)
    Console().print(table)
    write_markdown(args.out, "forward", [table])
    bar_plot(
        args.out,
        "forward",
        title=f"Paged runner vs transformers (DynamicCache): greedy decode, {torch.get_num_threads()} threads, "
        f"best of {args.repeats}",
        xlabel="batch size",
        ylabel="tokens/s",
        categories=[str(b) for b in batches],
        series={"paged runner": paged, "transformers": reference},
        ratios=[o / t for o, t in zip(paged, reference, strict=True)],
    )


if __name__ == "__main__":
    main()
