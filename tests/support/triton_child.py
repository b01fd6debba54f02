"""Test helper: run a test module as a script in a child process under Triton's interpreter, and read the JSON it
prints last. ``TRITON_INTERPRET=1`` must be set before triton is first imported and then holds for the whole process
(vLLM's kernels too, on a GPU host), so the checks that need it run apart from the rest of the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def interpreted_run(script: str, *args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.splitlines()[-1])
