"""The CLI when things are dead: a Ray head that is gone, a replica or inferlet host killed under a running Pie.

Every expected failure is one line and a non-zero exit (or a clean no-op), never a traceback or a hang; `pie status`
shows what is dead; `pie stop` works with parts dead and leaves nothing that the next `pie start` trips on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.pie_procs import PIE, engine_status, free_port

VENV_BIN = Path(sys.executable).parent


def dead_address() -> str:
    """A GCS address where nothing listens: a port that was just free."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def pie(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # the timeout only keeps a hang from stalling the suite: Ray's own join retries a dead address for minutes
    return subprocess.run([*PIE, *args], env=env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(got: subprocess.CompletedProcess, *expected: str) -> None:
    assert got.returncode == 1, (got.stdout, got.stderr)
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in got.stderr, got.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def test_status_and_submit_against_a_dead_ray_head_fail_in_one_line(tmp_path):
    address = dead_address()
    env = {**os.environ, "PIE_HOME": str(tmp_path), "RAY_ADDRESS": address}
    assert_one_line_error(pie(env, "status"), "no Ray cluster answers at", address)
    assert_one_line_error(pie(env, "status", "--address", address), "no Ray cluster answers at", address)


def test_stop_after_the_head_died_clears_the_record_so_start_starts_clean(tmp_path):
    """`pie start` recorded a head that has since died (its record is what is left after a crash)."""
    address = dead_address()
    (tmp_path / "cluster.json").write_text(json.dumps({"address": address, "url": "http://127.0.0.1:1"}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PIE_HOME": str(tmp_path)}
    assert_one_line_error(pie(env, "status"), address, "where `pie start` recorded it")
    stopped = pie(env, "stop")
    assert stopped.returncode == 0 and "nothing left to stop" in stopped.stdout, stopped.stderr
    assert not (tmp_path / "cluster.json").exists()


def test_rays_cli_is_found_beside_the_interpreter_when_the_venv_is_not_activated():
    script = "from pie_cluster.ray_session import ray_cli; print(ray_cli())"
    got = subprocess.run(
        [sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()) == VENV_BIN / "ray"


@pytest.fixture(scope="module")
def started(ray_cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("pie-failures")
    config = home / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        [server]
        port = {free_port()}
        ingress_replicas = 2
        [auth]
        enabled = false
        [launcher]
        max_running_per_user = 2
        max_queued_per_user = 1
        [[model]]
        name = "victim"
        pages = 64
        cpus_per_rank = 1
        """)
    )
    env = {**os.environ, "PIE_HOME": str(home), "RAY_ADDRESS": ray_cluster.address}
    got = pie(env, "start", "--config", str(config), timeout=300)
    assert got.returncode == 0, got.stderr
    yield {"env": env, "config": config, "url": json.loads((home / "cluster.json").read_text())["url"]}
    pie(env, "stop")


def test_two_ingress_replicas_from_the_config_serve_launches(started, ray_session):
    import httpx
    from ray import serve

    ingress = serve.status().applications["pie"].deployments["PieIngress"]
    assert ingress.replica_states.get("RUNNING") == 2, ingress
    program = httpx.post(
        f"{started['url']}/v1/programs",
        params={"filename": "p.py"},
        content=b"async def main(input):\n    return input['i'] * 2\n",
        timeout=60,
    ).json()["program"]
    for i in range(8):  # Serve's proxy spreads them over both replicas
        events = httpx.post(
            f"{started['url']}/v1/instances",
            params={"stream": "true"},
            json={"program": program, "input": {"i": i}},
            timeout=60,
        )
        assert events.status_code == 200 and f"event: return\ndata: {json.dumps(str(i * 2))}" in events.text


WAIT = b"from inferlet import session\n\nasync def main(input):\n    return await session.receive()\n"


def test_launches_past_the_limits_wait_then_are_refused_with_429(started, tmp_path):
    import httpx

    url = started["url"]
    uploaded = httpx.post(f"{url}/v1/programs", params={"filename": "wait.py"}, content=WAIT, timeout=60)
    program = uploaded.json()["program"]

    def launch() -> httpx.Response:
        return httpx.post(f"{url}/v1/instances", json={"program": program}, timeout=60)

    def states() -> dict[str, str]:
        return {i["id"]: i["status"] for i in httpx.get(f"{url}/v1/instances", timeout=60).json()}

    first, second, third = (launch().json()["id"] for _ in range(3))
    assert [states()[i] for i in (first, second, third)] == ["running", "running", "queued"]
    refused = launch()
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json() == {"detail": "user 'local' already has 1 launches waiting (the limit)"}
    chat = {"model": "victim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # an OpenAI request is a launch like any
    overloaded = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert overloaded.status_code == 429 and int(overloaded.headers["Retry-After"]) >= 1
    assert overloaded.json()["error"]["type"] == "rate_limit_error"
    path = tmp_path / "p.py"
    path.write_text("async def main(input):\n    return 1\n")
    cli = pie({**started["env"], "PIE_URL": url}, "submit", str(path))
    assert cli.returncode == 1 and "429" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr

    left = httpx.delete(f"{url}/v1/instances/{third}", timeout=60)  # a waiting launch leaves
    assert left.json() == {"aborted": True}
    assert states()[third] == "failed"
    fourth = launch().json()["id"]
    assert states()[fourth] == "queued"
    httpx.post(f"{url}/v1/instances/{first}/messages", json={"message": "one"}, timeout=60)
    events = httpx.get(f"{url}/v1/instances/{first}/events", timeout=60).text
    assert 'event: return\ndata: "one"' in events
    for _ in range(100):  # the freed slot goes to the waiting launch
        if states()[fourth] == "running":
            break
        time.sleep(0.1)
    assert states()[fourth] == "running"
    for instance in (second, fourth):
        httpx.post(f"{url}/v1/instances/{instance}/messages", json={"message": "done"}, timeout=60)
        assert "event: return" in httpx.get(f"{url}/v1/instances/{instance}/events", timeout=60).text


def events_text(url: str, instance: str, within: float = 120) -> str:
    """The instance's SSE stream up to its end, or what came of it within ``within`` seconds (no hang)."""
    import httpx

    text, deadline = "", time.monotonic() + within
    with httpx.stream("GET", f"{url}/v1/instances/{instance}/events", timeout=within) as response:
        for line in response.iter_lines():
            text += line + "\n"
            if time.monotonic() > deadline:
                break
    return text


def test_a_killed_inferlet_host_fails_its_instances_and_comes_back(started, ray_cluster):
    import httpx

    url = started["url"]
    node = json.loads(pie(started["env"], "status", "--json").stdout)["nodes"][0]["node"]
    uploaded = httpx.post(f"{url}/v1/programs", params={"filename": "wait.py"}, content=WAIT, timeout=60)
    program = uploaded.json()["program"]
    lost = httpx.post(f"{url}/v1/instances", json={"program": program, "node_id": node}, timeout=60).json()["id"]
    host = only_actor(ray_cluster.address, "InferletHost", node_id=node)
    os.kill(host["pid"], signal.SIGKILL)
    events = events_text(url, lost)
    assert "event: error" in events and "died" in events, events
    assert {i["id"]: i["status"] for i in httpx.get(f"{url}/v1/instances", timeout=60).json()}[lost] == "failed"
    deadline = time.monotonic() + 120
    while (
        again := httpx.post(
            f"{url}/v1/instances", json={"program": program, "node_id": node, "deadline_s": 60}, timeout=60
        )
    ).status_code == 503:
        assert "host is down" in again.text and time.monotonic() < deadline, again.text  # restarting: try again
        time.sleep(0.5)
    instance = again.json()["id"]
    httpx.post(f"{url}/v1/instances/{instance}/messages", json={"message": "back"}, timeout=60)
    assert 'event: return\ndata: "back"' in httpx.get(f"{url}/v1/instances/{instance}/events", timeout=60).text
    assert only_actor(ray_cluster.address, "InferletHost", node_id=node)["pid"] != host["pid"]


def test_serves_proxy_gets_time_to_start_on_a_loaded_head(started, ray_cluster):
    """Serve kills a proxy that is not ready within its ready-check timeout (5 s by default) and starts another, and
    the `serve.start` that waited on the first fails: seen in CI, where a worker process took 17 s to start. The
    job's environment, which Serve's controller inherits, gives a proxy 30 s."""
    from ray.util.state import list_actors

    alive = [("class_name", "=", "ServeController"), ("state", "=", "ALIVE")]
    (controller,) = list_actors(ray_cluster.address, filters=alive, detail=True)
    env = json.loads(controller["serialized_runtime_env"])["env_vars"]
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30", env


def only_actor(address: str, class_name: str, **match) -> dict:
    """The one live actor of this Pie of ``class_name`` (and ``match``ing fields), from Ray's state API."""
    from ray.util.state import list_actors

    found = [
        a
        for a in list_actors(address, filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")], detail=True)
        if a["ray_namespace"] == "pie" and all(a[k] == v for k, v in match.items())
    ]
    assert len(found) == 1, found
    return found[0]


GENERATE = b"""
from inferlet import Context, Model, Sampler

async def main(input):
    model = Model.load("victim")
    if input.get("op") == "open":  # the snapshot, from wherever it now is
        ctx = Context.open(model, "kept")
    else:
        ctx = Context(model)
        ctx.user("hello " * 20)
    with ctx:
        if input.get("op") == "save":
            await ctx.flush()
            ctx.save("kept")
        return await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
"""


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_stop_then_start_works(started, ray_cluster):
    import httpx

    env, url = started["env"], started["url"]
    report = json.loads(pie(env, "status", "--json").stdout)
    assert [r["state"] for r in report["replicas"]] == ["serving"] and report["replica_restarts"] == 0
    assert all(n["alive"] and n["host"] == "serving" for n in report["nodes"])
    uploaded = httpx.post(f"{url}/v1/programs", params={"filename": "gen.py"}, content=GENERATE, timeout=60)
    program = uploaded.json()["program"]

    def returned(input: dict) -> list[int]:
        events = httpx.post(
            f"{url}/v1/instances", params={"stream": "true"}, json={"program": program, "input": input}, timeout=120
        ).text
        assert "event: return" in events, events
        return json.loads(json.loads(events.split("event: return\ndata: ", 1)[1].split("\n", 1)[0]))

    saved = returned({"op": "save"})  # its only copy is on the replica about to die

    rank = only_actor(ray_cluster.address, "RankWorker")
    os.kill(rank["pid"], signal.SIGKILL)  # a real crash, not a polite ray.kill
    for _ in range(300):  # the controller notices (every 2 s) and loads a replacement (polled over this session's
        report = engine_status(started)  # Ray connection: a `pie status` process costs seconds of imports)
        if report["replica_restarts"] == 1 and report["replicas"][0]["state"] == "serving":
            break
        time.sleep(0.5)
    report = json.loads(pie(env, "status", "--json").stdout)  # what the command prints says so too
    assert report["replica_restarts"] == 1 and report["replicas"][0]["state"] == "serving", report
    assert only_actor(ray_cluster.address, "RankWorker")["pid"] != rank["pid"]
    shown = pie(env, "status")
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr

    assert len(returned({})) == 4  # new launches reach the replacement
    assert returned({"op": "open"}) == saved  # the snapshot outlived its replica: recomputed from its lineage

    stopped = pie(env, "stop")
    assert stopped.returncode == 0 and "Pie stopped" in stopped.stdout, stopped.stderr
    assert pie(env, "status").returncode == 1  # nothing left running
    again = pie(env, "start", "--config", str(started["config"]), timeout=300)
    assert again.returncode == 0, again.stderr
    report = json.loads(pie(env, "status", "--json").stdout)
    assert [r["state"] for r in report["replicas"]] == ["serving"]
