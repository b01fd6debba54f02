"""`pie start` / `pie stop` as a user runs them, on the test session's Ray cluster, for the modules that test a
started cluster over HTTP (each module starts its own, one at a time, and stops it at its end)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

PIE = [sys.executable, "-m", "pie_cluster.cli.app"]


def free_port() -> int:
    """A free port in 20000-29999: above Ray's worker ports (10002-19999) and below the ephemeral range Ray's own
    processes keep binding (a port taken from there can be gone again by the time Serve binds it)."""
    for port in random.Random().sample(range(20000, 30000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")


RAY_TEMP = f"/tmp/ray-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
"""This test session's own Ray directory: Ray finds "the cluster on this machine" (its job supervisor does, to give
a job's driver its address) through a file there, which test sessions running side by side must not share."""


def own_node() -> dict:
    """``Cluster`` node arguments for a raylet of this test session: its job agent on a free port instead of Ray's
    fixed default (52365), which every other raylet on this machine would try to bind too, the session's own Ray
    directory, and no log monitor (it tails every worker's log for drivers that print none here: 104 CPU-s over a
    full parallel run)."""
    return {"dashboard_agent_listen_port": free_port(), "temp_dir": RAY_TEMP, "include_log_monitor": False}


def started_pie(
    ray_cluster, home: Path, extra_config: str = "", server: str = "", model: str = "", args: tuple[str, ...] = ()
) -> Iterator[dict]:
    """Start the services with two users (tokens ``tok-alice``, ``tok-bob``) and the tiny model as "default";
    yields the base URL, the environment, the home directory and what `pie start` printed on stderr, and stops them
    afterwards. ``server`` and ``model``: more lines for the ``[server]`` and ``[[model]]`` tables; ``args``: more
    of `pie start`'s options."""
    port = free_port()
    config = home / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        [server]
        port = {port}
        {server}
        [auth]
        tokens = {{ "tok-alice" = "alice", "tok-bob" = "bob" }}
        [[model]]
        pages = 256
        cpus_per_rank = 1
        max_batch_tokens = 512
        {model}
        """)
        + textwrap.dedent(extra_config)
    )
    config.chmod(0o644)  # as an editor leaves it: `pie start` warns that other local users can read the tokens
    env = {**os.environ, "PIE_HOME": str(home), "RAY_ADDRESS": ray_cluster.address}
    started = subprocess.run(
        [*PIE, "start", "--config", str(config), "--address", ray_cluster.address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:  # Serve's proxy comes up a moment after the app is deployed
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    yield {"url": url, "env": env, "home": home, "start_log": started.stderr}
    stopped = subprocess.run([*PIE, "stop", "--address", ray_cluster.address], env=env, capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr


def engine_status(pie: dict) -> dict:
    """The report `pie status --json` prints (the same call, JSON round trip included), read from the controller
    over this test session's Ray connection: a `pie status` process costs seconds of imports and joining, and the
    tests that ask for it dozens of times do not test the command (``tests/cluster/cli`` and ``test_http_cli`` do)."""
    import ray
    from pie_cluster.control.lifecycle import CONTROLLER
    from pie_cluster.control.status_records import status_json
    from pie_cluster.ray_session import NAMESPACE

    controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    return json.loads(json.dumps(status_json(ray.get(controller.status.remote(), timeout=120))))


def pie_start_refused(jail: list[str], home: Path) -> str:
    """Run `pie start` (its config: auth with one token, under ``home``) inside ``jail`` (a bwrap command line that
    confines it), expecting it to refuse in one clear line: that line, whitespace folded."""
    config = home / "config.toml"
    config.write_text('[auth]\ntokens = { "t" = "alice" }\n')
    config.chmod(0o644)
    argv = [*jail, "--setenv", "PIE_HOME", str(home), sys.executable, "-m", "pie_cluster.cli.app", "start"]
    got = subprocess.run([*argv, "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, got.stderr
    assert "Traceback" not in got.stderr
    return " ".join(got.stderr.split())
