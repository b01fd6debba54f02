"""Decode throughput of the paged runner, both backends, against transformers and vLLM's own engine.

Usage: python bench/forward.py [--models tiny,bigger] [--batches 1,8,32,64] [--long 1024,2048] [--long-batch 16]
                               [--steps 64] [--long-steps 16] [--repeats 3] [--no-engine] [--out docs/bench]

Every column decodes greedily from the same random prompts (equal length, no padding) and times decode steps only,
after an untimed prefill: the paged runner with the ``torch`` backend (SDPA over gathered pages, torch's oneDNN
matmuls on packed weights) and with the ``vllm`` backend (vLLM's paged attention over its own cache layout, its fused
RMSNorm and rotary, its oneDNN matmuls on packed weights), transformers' batched forward with
its ``DynamicCache``, and vLLM's own engine (``LLM.generate`` offline, in its virtualenv from ``make vllm-peer``;
its decode time is a generate of ``steps + 1`` tokens minus a generate of one); each backend also with its decode
steps compiled (``RunnerSettings.compile = "on"``, one graph per row's batch size, made before timing: on a CPU by
``torch.compile``, on a GPU CUDA graphs of the torch backend's steps). Rows: short
prompts at several batch sizes, and long prompts at one batch size where avoiding the page gather should show.
Models: the embedded tiny Llama (overhead-bound) and a bigger random-weight Llama (hidden 1,024, 8 layers). Best of
``repeats``, the sides interleaved. Writes ``OUT/forward.md`` and ``OUT/forward.png``.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass, field

import torch
import vllm_peer
from pie_workers.runner import ModelRunner, RunnerSettings
from pie_workers.tiny_model import default_model_path
from pie_workers.wire.batch import ForwardBatch, ForwardRequest, Slot
from pie_workers.wire.pages import pages_for
from random_model import random_llama
from report import add_out_option, bar_plot, write_markdown
from rich.console import Console
from rich.table import Table


@dataclass
class Row:
    model: str
    batch: int
    prompt: int
    steps: int
    prompts: list[list[int]] = field(default_factory=list)
    speeds: dict[str, float] = field(default_factory=dict)  # column -> decode tokens/s


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
        out = model(torch.tensor(prompts, device=model.device), past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        nxt.cpu()  # waits for a GPU to finish
        return len(prompts) * steps / (time.perf_counter() - start)


def measure_model(label: str, model_dir, rows: list[Row], args, console: Console) -> None:
    from transformers import AutoModelForCausalLM

    pages = max(r.batch * pages_for(r.prompt + r.steps + 1, 16) for r in rows)
    gpu = torch.cuda.is_available()  # the runner then defaults to the GPU in bf16; so does transformers here
    eager = dict(num_pages=pages, compile="off")
    runners = {"torch": ModelRunner(model_dir, RunnerSettings(backend="torch", **eager))}
    try:  # on a GPU host the vllm backend needs vLLM's CUDA build (make gpu-check installs it)
        runners["vllm"] = ModelRunner(model_dir, RunnerSettings(backend="vllm", **eager))
    except (ImportError, RuntimeError, ValueError) as e:
        console.log(f"vllm backend skipped: {e}")
    sizes = tuple(sorted({r.batch for r in rows}))
    for backend in list(runners):
        start = time.perf_counter()
        settings = RunnerSettings(num_pages=pages, backend=backend, compile="on", compile_sizes=sizes)
        try:  # on a GPU: CUDA graphs, for the torch backend only
            runners[f"{backend} compiled"] = ModelRunner(model_dir, settings)
        except ValueError as e:
            console.log(f"{backend} compiled skipped: {e}")
            continue
        console.log(f"{backend} compiled: {len(sizes)} graphs in {time.perf_counter() - start:.1f} s")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32).eval()
    hf = hf.to("cuda" if gpu else "cpu")
    rng = random.Random(0)
    vocab = runners["torch"].cfg.vocab_size
    for row in rows:
        row.prompts = [[rng.randrange(3, vocab) for _ in range(row.prompt)] for _ in range(row.batch)]
        for _ in range(args.repeats):  # interleaved, best of N: every side sees the same machine noise
            speeds = {name: paged_decode(runner, row.prompts, row.steps) for name, runner in runners.items()}
            speeds["transformers"] = hf_decode(hf, row.prompts, row.steps)
            row.speeds = {name: max(row.speeds.get(name, 0.0), speed) for name, speed in speeds.items()}
            for name in ("vllm", "torch compiled", "vllm compiled"):
                row.speeds.setdefault(name, float("nan"))
        console.log(
            f"{label} batch {row.batch} x {row.prompt}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.speeds.items())
        )
    runners.clear()  # free their pools before vLLM's engine takes its own memory
    if args.engine and vllm_peer.available() is None:
        specs = [{"prompts": r.prompts, "steps": r.steps} for r in rows]
        for row, speed in zip(rows, vllm_peer.engine_decode(model_dir, specs, repeats=args.repeats), strict=True):
            row.speeds["vllm engine"] = speed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,bigger")
    ap.add_argument("--batches", default="1,8,32,64", help="batch sizes of the short-prompt rows")
    ap.add_argument("--prompt", type=int, default=32, help="short prompt length")
    ap.add_argument("--steps", type=int, default=64, help="decode steps of the short rows")
    ap.add_argument("--long", default="1024,2048", help="long prompt lengths (one row each)")
    ap.add_argument("--long-batch", type=int, default=16)
    ap.add_argument("--long-steps", type=int, default=16)
    ap.add_argument("--bigger-long", default="1024", help="long prompt lengths on the bigger model (slow prefill)")
    ap.add_argument("--bigger-model", default=None, help="HF directory for the bigger model (default: hidden 1,024)")
    ap.add_argument("--repeats", type=int, default=3, help="best of N runs per cell")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="skip vLLM's own engine")
    add_out_option(ap)
    args = ap.parse_args()
    console = Console(width=140)
    models = {"tiny": default_model_path("llama"), "bigger": args.bigger_model or random_llama()}
    all_rows: list[Row] = []
    for label in args.models.split(","):
        long = args.long if label == "tiny" else args.bigger_long
        rows = [Row(label, int(b), args.prompt, args.steps) for b in args.batches.split(",")]
        rows += [Row(label, args.long_batch, int(n), args.long_steps) for n in long.split(",") if n]
        measure_model(label, models[label], rows, args, console)
        all_rows += rows
    report(all_rows, args, console)


def report(rows: list[Row], args, console: Console) -> None:
    engine = any("vllm engine" in r.speeds for r in rows)
    vllm = not all(math.isnan(r.speeds["vllm"]) for r in rows)  # a GPU host without vLLM's CUDA build has none
    title = f"greedy decode tokens/s, {torch.get_num_threads()} threads, best of {args.repeats}"
    table = Table(title=title)
    compiled = [b for b in ("torch", "vllm") if not all(math.isnan(r.speeds[f"{b} compiled"]) for r in rows)]
    columns = ["model", "batch x prompt", "torch backend"] + (["vllm backend", "vllm / torch"] if vllm else [])
    columns += [c for b in compiled for c in (f"{b} compiled", f"{b} compiled / eager")]
    columns += ["transformers", "torch / HF"] + (["vllm / HF"] if vllm else [])
    columns += ["vLLM engine", "vllm backend / engine"] if engine else []
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        s = r.speeds
        cells = [r.model, f"{r.batch} x {r.prompt}", f"{s['torch']:,.0f}"]
        cells += [f"{s['vllm']:,.0f}", f"{s['vllm'] / s['torch']:.2f}x"] if vllm else []
        cells += [c for b in compiled for c in (f"{s[f'{b} compiled']:,.0f}", f"{s[f'{b} compiled'] / s[b]:.2f}x")]
        cells += [f"{s['transformers']:,.0f}", f"{s['torch'] / s['transformers']:.2f}x"]
        cells += [f"{s['vllm'] / s['transformers']:.2f}x"] if vllm else []
        if engine:
            cells += [f"{s['vllm engine']:,.0f}", f"{s['vllm'] / s['vllm engine']:.2f}x"]
        table.add_row(*cells)
    console.print(table)
    note = "" if engine else f"vLLM's engine: {vllm_peer.available() or 'skipped (--no-engine)'}"
    write_markdown(args.out, "forward", [table, note] if note else [table])
    plot(rows, args)


def plot(rows: list[Row], args) -> None:
    """Every column relative to the torch backend, so the tiny and the bigger model share one scale."""
    columns = [
        c
        for c in ("vllm", "torch compiled", "vllm compiled", "transformers", "vllm engine")
        if any(not math.isnan(r.speeds.get(c, math.nan)) for r in rows)
    ]
    labels = {"vllm": "vllm backend", "transformers": "transformers", "vllm engine": "vLLM engine"}
    labels |= {f"{b} compiled": f"{b} backend, compiled" for b in ("torch", "vllm")}
    bar_plot(
        args.out,
        "forward",
        title=f"Greedy decode speed relative to the torch backend ({torch.get_num_threads()} threads)",
        xlabel="model, batch x prompt tokens",
        ylabel="tokens/s / torch backend's",
        categories=[f"{r.model}\n{r.batch}x{r.prompt}" for r in rows],
        series={labels[c]: [r.speeds[c] / r.speeds["torch"] for r in rows] for c in columns},
        value_format="{x:.1f}x",
    )


if __name__ == "__main__":
    main()
