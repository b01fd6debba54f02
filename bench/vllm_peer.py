"""vLLM's own engine as a benchmark peer, run from its own venv (`make vllm-peer`) behind its OpenAI server.

Standard library only: this is imported by benchmarks in the project's .venv, which does not have vLLM's server.
"""

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / ".venv-vllm"
PEER_PYTHON = PEER_VENV / "bin" / "python"
STAMP = PEER_VENV / ".installed"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


def available() -> str | None:
    """None when the peer venv is installed; else a one-line reason, for benchmarks to print and skip the peer."""
    if not (PEER_PYTHON.exists() and STAMP.exists()):
        return "vLLM's engine is not installed: run `make vllm-peer`"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (the server spawns an engine process), SIGKILL if it has not gone in 20 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _peer_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The peer's environment: without the caller's venv (it must import only its own), its threads pinned to cores
    0..threads-1 (vLLM's CPU backend takes its thread count only from VLLM_CPU_OMP_THREADS_BIND), offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    env.update(HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    return env


@contextmanager
def openai_server(model_dir: Path, served_name: str, threads: int = 2, max_model_len: int = 1024) -> Iterator[str]:
    """Start vLLM's OpenAI server on `model_dir`, yield its base URL ("http://127.0.0.1:PORT/v1"), stop it on exit.

    float32 to match the project's CPU runs; prefix caching stays at vLLM's default (on). Its Responses API keeps
    stored responses (``VLLM_ENABLE_RESPONSES_API_STORE``, off by default), so ``previous_response_id`` works.
    """
    reason = available()
    if reason:
        raise RuntimeError(reason)
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    env = _peer_env(threads, kv_cache_gib=2) | {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    cmd = [
        str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            # cwd=tmp: `python -m` puts the cwd on sys.path, and the peer must import only its own venv.
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _answers(f"{base}/models"):
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM's server exited with {proc.returncode}:\n{_tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM's server did not answer in {START_TIMEOUT_S:.0f} s:\n{_tail(log)}")
                time.sleep(0.5)
            yield base
        finally:
            _stop(proc)


class RestartingServer:
    """vLLM's OpenAI server for a bench of many cells, started when a cell first needs it and again when a cell finds
    it dead: under load it may drop connections and exit, and that should cost only the cells that ran into it. A
    start that fails is not tried again (each may take minutes): the later cells fail with its reason
    (``describe(error)``)."""

    def __init__(self, skipped: str | None, model_dir: Path, served_name: str, describe: Callable, threads: int = 2):
        self.skipped = skipped  # not installed or not asked for: its systems do not run at all
        self.broken: str | None = None
        self.starts, self.restarts = 0, 0
        self._start = lambda: openai_server(model_dir, served_name, threads=threads)
        self._threads = threads
        self._describe = describe
        self._url: str | None = None
        self._server = ExitStack()

    def url(self) -> str:
        if self._url and not _answers(f"{self._url}/models"):
            self.close()
            self.restarts += 1
        if self._url is None:
            if self.broken:
                raise RuntimeError(f"vLLM's server is down: {self.broken}")
            try:
                self._url = self._server.enter_context(self._start())
                self.starts += 1
            except Exception as error:
                self.broken = self._describe(error)
                raise
        return self._url

    def close(self) -> None:
        self._server.close()
        self._url = None

    def note(self) -> str:
        if self.skipped:
            return f"vLLM's server: {self.skipped}"
        note = f"vLLM's server: vllm-cpu 0.32.0, prefix caching on, its Responses store on, {self._threads} threads"
        if self.restarts:
            note += f"; found dead and restarted {self.restarts} time(s)"
        return note + (f"; could not be started: {self.broken}" if self.broken else "")


def engine_decode(model_dir: Path, rows: list[dict], threads: int = 2, repeats: int = 2) -> list[float]:
    """Decode tokens/s of vLLM's offline engine (``LLM.generate``) on each row ``{"prompts": [[ids]], "steps": n}``,
    run in the peer's interpreter (``vllm_engine_decode.py``), with ``threads`` cores."""
    reason = available()
    if reason:
        raise RuntimeError(reason)
    longest = max(len(p) for row in rows for p in row["prompts"]) + max(row["steps"] for row in rows) + 8
    env = _peer_env(threads, kv_cache_gib=4)
    with tempfile.TemporaryDirectory(prefix="vllm-engine-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(dict(model=str(model_dir), max_model_len=longest, rows=rows, repeats=repeats)))
        got = subprocess.run(
            [str(PEER_PYTHON), str(Path(__file__).with_name("vllm_engine_decode.py")), str(spec)],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
    if got.returncode != 0:
        raise RuntimeError(f"vLLM's engine failed ({got.returncode}):\n{got.stderr[-2000:]}")
    (result,) = [line for line in got.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(result.removeprefix("RESULT "))
