"""`pie start` on the test's Ray cluster, then the HTTP endpoint (Ray Serve) and the `pie` client commands against
it: launch, SSE events, session messages, abort, per-user isolation, `pie submit` over HTTP and as a Ray job."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from pie_cluster.client import PieClient, PieClientError

ROOT = Path(__file__).resolve().parent.parent
PIE = [sys.executable, "-m", "pie_cluster.cli"]


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


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    """`pie start` as a user would run it, joining the session's cluster; `pie stop` afterwards."""
    home = tmp_path_factory.mktemp("pie-home")
    port = free_port()
    config = home / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        [server]
        port = {port}
        [auth]
        tokens = {{ "tok-alice" = "alice", "tok-bob" = "bob" }}
        [[model]]
        pages = 256
        cpus_per_rank = 1
        max_batch_tokens = 512
        """)
    )
    env = {**os.environ, "PIE_HOME": str(home), "RAY_ADDRESS": ray_cluster.address}
    started = subprocess.run(
        [*PIE, "start", "--config", str(config), "--address", ray_cluster.address],
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
    yield {"url": url, "env": env, "home": home}
    stopped = subprocess.run([*PIE, "stop", "--address", ray_cluster.address], env=env, capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr


def client(pie, token="tok-alice") -> PieClient:
    return PieClient(pie["url"], token)


def write_program(tmp_path: Path, source: str, name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def pie_cli(pie, *args, token="tok-alice", timeout=180) -> subprocess.CompletedProcess:
    env = {**pie["env"], "PIE_URL": pie["url"], "PIE_TOKEN": token}
    return subprocess.run(
        [*PIE, *args], env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def engine_status(pie) -> dict:
    got = subprocess.run([*PIE, "status", "--json"], env=pie["env"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_auth_health_metrics_and_openapi(pie):
    assert httpx.get(f"{pie['url']}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{pie['url']}/v1/instances").status_code == 401
    assert httpx.get(f"{pie['url']}/v1/instances", headers={"Authorization": "Bearer nope"}).status_code == 401
    schema = httpx.get(f"{pie['url']}/openapi.json").json()
    assert {"/v1/programs", "/v1/instances", "/v1/instances/{instance_id}/events"} <= set(schema["paths"])
    assert "pie_instances_running" in httpx.get(f"{pie['url']}/metrics").text


CHAT = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user(input["prompt"])
        text = await ctx.generate(Sampler.argmax(), max_tokens=8).collect_text()
    session.send({"draft": text})
    verdict = await session.receive()
    return f"{verdict}: {text}"
"""


def test_launch_streams_events_and_round_trips_a_session_message(pie, tmp_path, served):
    c = client(pie)
    program = c.upload(write_program(tmp_path, CHAT))
    assert program["name"] == "prog@0.0.0"
    instance = c.launch(program["program"], {"prompt": "hello"})
    events = c.events(instance)
    index, kind, value = next(events)
    assert (index, kind) == (0, "message")
    draft = json.loads(value)["draft"]
    c.send(instance, "approved")
    assert list(events) == [(1, "return", f"approved: {draft}")]
    replayed = list(c.events(instance))  # a late attach replays everything from the start
    assert [k for _, k, _ in replayed] == ["message", "return"]

    # The same in one request: the launch answers with the stream, opened by the instance's id.
    events = c.launch_and_follow(program["program"], {"prompt": "hello"})
    index, kind, second = next(events)
    assert (index, kind) == (-1, "launched") and second != instance
    assert second in {i["id"] for i in c.list()}
    index, kind, value = next(events)
    assert (index, kind, json.loads(value)) == (0, "message", {"draft": draft})
    c.send(second, "approved")
    assert list(events) == [(1, "return", f"approved: {draft}")]


LONG = """
from inferlet import Context, Model, Sampler

async def main(input):
    ctx = Context(Model.load("default"))
    ctx.user("a long story please")
    async for step in ctx.generate(Sampler.argmax(), max_tokens=100000, stop=[]):
        await step.execute()
"""


def test_abort_mid_generation_frees_its_pages(pie, tmp_path):
    c = client(pie)
    instance = c.launch(c.upload(write_program(tmp_path, LONG))["program"])
    time.sleep(2.0)
    (replica,) = engine_status(pie)["replicas"]
    assert replica["contexts"] == 1 and replica["pages_used"] > 0
    assert c.abort(instance) is True
    assert list(c.events(instance))[-1][1:] == ("error", "aborted by its user")
    (replica,) = engine_status(pie)["replicas"]
    assert replica["contexts"] == 0 and replica["pages_used"] == 0


SAVE = """
from inferlet import Context, Model

async def main(input):
    model = Model.load("default")
    if input["op"] == "save":
        with Context(model) as ctx:
            ctx.user("remember this")
            await ctx.flush()
            ctx.save("secret")
        return "saved"
    opened = Context.open(model, "secret")
    return "none" if opened is None else f"opened {opened.seq_len}"
"""


def test_a_second_user_cannot_list_attach_abort_or_open_the_first_users_things(pie, tmp_path):
    alice, bob = client(pie), client(pie, "tok-bob")
    program = alice.upload(write_program(tmp_path, SAVE))["program"]
    saved = alice.launch(program, {"op": "save"})
    assert list(alice.events(saved))[-1][1:] == ("return", "saved")
    assert saved not in [i["id"] for i in bob.list()]
    for attempt in (lambda: list(bob.events(saved)), lambda: bob.abort(saved), lambda: bob.send(saved, "hi")):
        with pytest.raises(PieClientError, match="404"):
            attempt()
    bob_program = bob.upload(write_program(tmp_path, SAVE))["program"]
    assert list(bob.events(bob.launch(bob_program, {"op": "open"})))[-1][1:] == ("return", "none")
    kind, value = list(alice.events(alice.launch(program, {"op": "open"})))[-1][1:]
    assert kind == "return" and value.startswith("opened ")


def test_pie_submit_over_http_folds_arguments_and_prints_the_return_value(pie, served):
    from pie_cluster.host import load_program

    got = pie_cli(pie, "submit", str(ROOT / "examples/text_completion.py"), "--", "--prompt", "hi", "--max-tokens", "8")
    assert got.returncode == 0, got.stderr
    expected = served.run(load_program(ROOT / "examples/text_completion.py"), {"prompt": "hi", "max_tokens": 8})
    assert got.stdout.strip() == expected.strip()


def test_pie_submit_detach_list_attach_and_abort(pie, tmp_path):
    path = write_program(tmp_path, LONG)
    detached = pie_cli(pie, "submit", "--detach", str(path), "--input", "{}")
    assert detached.returncode == 0, detached.stderr
    instance = detached.stdout.strip()
    listed = pie_cli(pie, "list")
    assert instance in listed.stdout and "running" in listed.stdout
    assert instance not in pie_cli(pie, "list", token="tok-bob").stdout
    assert pie_cli(pie, "abort", instance[:8], token="tok-bob").returncode == 1  # not bob's
    aborted = pie_cli(pie, "abort", instance[:8])
    assert aborted.returncode == 0 and "abort sent" in aborted.stderr
    attached = pie_cli(pie, "attach", instance[:8])
    assert attached.returncode == 1 and "Error: aborted by its user" in attached.stderr


def test_an_inferlet_error_exits_non_zero_with_its_message(pie, tmp_path):
    path = write_program(tmp_path, "async def main(input):\n    raise ValueError('bad ' + input['x'])\n")
    got = pie_cli(pie, "submit", str(path), "--", "--x", "thing")
    assert got.returncode == 1 and "ValueError: bad thing" in got.stderr


def test_pie_submit_as_a_ray_job(pie, ray_cluster, served):
    from pie_cluster.host import load_program

    dashboard = ray_cluster.head_node.address_info["webui_url"]
    got = pie_cli(
        pie,
        "submit",
        "--jobs",
        "--dashboard",
        dashboard,
        "--user",
        "alice",
        "--job-python",
        sys.executable,
        str(ROOT / "examples/text_completion.py"),
        "--",
        "--prompt",
        "hi",
        "--max-tokens",
        "8",
        timeout=300,
    )
    if got.returncode != 0 and "No available agent to submit job" in got.stderr:
        # Ray's job agent on a cluster_utils head sometimes never registers on a loaded 2-core box (seen in CI).
        pytest.skip("the test cluster's Ray job agent did not come up within 3 minutes")
    assert got.returncode == 0, got.stdout + got.stderr
    expected = served.run(load_program(ROOT / "examples/text_completion.py"), {"prompt": "hi", "max_tokens": 8})
    assert expected.strip() in got.stdout
