"""The sandbox, tried as an attacker would: user A's inferlets try every escape while user B's instance runs.

A `pie start`ed cluster with two users and the sandbox on (the default). Bob's instance saves a snapshot, queues a
private message and waits on his session; meanwhile alice's programs try to reach Ray, bob's snapshot and queue
(with a forged identity), other runtimes through ``gc``, the host's files, environment and network, and then take
their own worker down with a busy loop, a fork bomb and a memory blow-up. Each attempt must fail, only alice's
instances may end, and bob's finishes with his result; nothing may leak (contexts, wallets, admission slots).
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from pie_cluster.client import PieClient
from pie_cluster.config import SandboxConfig
from pie_cluster.hosts.sandbox.limits import WorkerLimits
from pie_cluster.launch_request import LaunchRequest
from support.pie_procs import engine_status, started_pie

SANDBOX = """
[sandbox]
stall_s = 3
memory_mib = 2048
max_processes = 48
"""


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-home"), SANDBOX)


def run(pie, token: str, source: str, tmp_path: Path, input: dict | None = None, name: str = "prog.py"):
    """Upload and launch as the token's user; returns (client, instance id)."""
    c = PieClient(pie["url"], token)
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    program = c.upload(path)["program"]
    return c, c.launch(LaunchRequest(program=program, input=input or {}))


def outcome(c: PieClient, instance: str) -> tuple[str, object]:
    """The terminal event: ("return", decoded value) or ("error", message)."""
    *_, (_, kind, value) = list(c.events(instance))
    return kind, json.loads(value) if kind == "return" else value


BOB = """
from inferlet import Context, Model, Sampler, messaging, session

async def main(input):
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user("bob's private notes")
        await ctx.flush()
        ctx.save("bob-notes")
        messaging.push("inbox", "for bob only")
        session.send("ready")
        go = await session.receive()
        text = await ctx.generate(Sampler.argmax(), max_tokens=4).collect_text()
    Context.delete(model, "bob-notes")
    return {"go": go, "text": text}
"""


@pytest.fixture
def bob(pie, tmp_path):
    """Bob's instance, running and waiting; the test ends by letting it finish and checking it did."""
    c, instance = run(pie, "tok-bob", BOB, tmp_path, name="bob.py")
    events = c.events(instance)
    assert next(events)[1:] == ("message", "ready")
    yield
    c.send(instance, "go")
    kind, value = outcome(c, instance)
    assert kind == "return", value
    assert value["go"] == "go" and isinstance(value["text"], str)


ESCAPES = """
import asyncio, dataclasses, gc, os, socket
from inferlet import Context, Model, messaging, runtime

def attempt(fn):
    try:
        return f"ESCAPED: {fn()!r:.200}"
    except BaseException as e:
        return f"refused: {type(e).__name__}: {e}"

def ray_actor():
    import ray
    ray.init(address="auto")
    return ray.get_actor("pie-launcher", namespace="pie")

def gcs():
    host, _, port = INPUT["gcs"].rpartition(":")
    return socket.create_connection((host, int(port)), timeout=1)

def secrets_in_proc():
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            found += [pid] if b"RAY_" in read(f"/proc/{pid}/environ", None) else []
        except OSError:
            pass
    if not found:
        raise LookupError("no process here shows Ray's environment")
    return found

def read(path, size=64):
    with open(path, "rb") as f:
        return f.read(size)

async def main(input):
    global INPUT
    INPUT = input
    users = {o.username for o in gc.get_objects() if isinstance(o, runtime.Runtime)}
    environment = sorted(os.environ)  # before `import ray` adds its own
    me = runtime.current()
    model = Model.load("default")
    as_bob = dataclasses.replace(me, username="bob", session="forged")
    forged = dataclasses.replace(as_bob, capability=me.capability.split(".")[0] + ".AAAA")
    attempts = {
        "ray": ray_actor,
        "gcs": gcs,
        "http": lambda: socket.create_connection(("127.0.0.1", input["port"]), timeout=1),
        "internet": lambda: socket.create_connection(("1.1.1.1", 80), timeout=1),
        "config": lambda: read(input["config"]),
        "passwd": lambda: read("/etc/passwd"),
        "ray_session": lambda: os.listdir("/tmp/ray"),
        "pie_cache": lambda: os.listdir(input["cache"]),
        "proc_environ": secrets_in_proc,
        "snapshot_as_bob": lambda: Context.open(Model(model.endpoint, as_bob), "bob-notes") or _none(),
        "snapshot_forged": lambda: Context.open(Model(model.endpoint, forged), "bob-notes") or _none(),
    }
    got = {}
    for name, escape in attempts.items():  # each in a task step of its own: the stall watchdog times steps
        got[name] = attempt(escape)
        await asyncio.sleep(0)
    token = runtime.install(as_bob)
    try:
        got["queue_as_bob"] = f"ESCAPED: {await asyncio.wait_for(messaging.pull('inbox'), 2)!r}"
    except BaseException as e:
        got["queue_as_bob"] = f"refused: {type(e).__name__}"
    finally:
        runtime.uninstall(token)
    got["runtimes"] = sorted(users)
    got["environment"] = environment
    got["uid"] = os.getuid()
    got["root"] = sorted(os.listdir("/"))
    got["tmp"] = sorted(os.listdir("/tmp"))
    return got

def _none():
    raise LookupError("no such snapshot")
"""


def test_every_escape_fails_while_another_users_instance_runs(pie, bob, tmp_path):
    port = int(pie["url"].rsplit(":", 1)[1])
    c, instance = run(
        pie,
        "tok-alice",
        ESCAPES,
        tmp_path,
        {
            "gcs": pie["env"]["RAY_ADDRESS"],
            "port": port,
            "config": str(pie["home"] / "config.toml"),
            "cache": str(Path.home() / ".cache" / "pie"),
        },
    )
    kind, got = outcome(c, instance)
    assert kind == "return", got
    for attempt in ("ray", "gcs", "http", "internet", "config", "passwd", "ray_session", "pie_cache", "proc_environ"):
        assert got[attempt].startswith("refused"), (attempt, got[attempt])
    assert got["snapshot_as_bob"].startswith("refused: LookupError"), got["snapshot_as_bob"]  # alice has none
    forged = got["snapshot_forged"]  # refused, and the connection that carried it closed
    assert forged.startswith("refused") and "malformed capability" in forged, forged
    assert got["queue_as_bob"] == "refused: TimeoutError"  # her own queue "inbox" is empty; bob's is not hers
    assert got["runtimes"] == ["alice"]  # her worker holds no other user's runtime
    assert not any(key.startswith(("RAY_", "PIE_")) for key in got["environment"]), got["environment"]
    assert got["uid"] != 0
    assert "home" not in got["root"] and "ray" not in got["tmp"]


BUSY = """
from inferlet import session
async def main(input):
    session.send("spinning")
    while True:
        pass
"""

WAITS = """
from inferlet import session
async def main(input):
    return await session.receive()
"""

FORK_BOMB = """
import os, time
async def main(input):
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
"""

MEMORY = """
async def main(input):
    hog = bytearray(4 << 30)  # over the worker's 2 GiB of address space
    return len(hog)
"""

HELLO = """
import os
async def main(input):
    return {"pid": os.getpid(), "uid": os.getuid()}
"""


def test_a_busy_loop_ends_only_its_users_worker_and_the_next_launch_gets_a_fresh_one(pie, bob, tmp_path):
    c, waiting = run(pie, "tok-alice", WAITS, tmp_path, name="waits.py")
    _, busy = run(pie, "tok-alice", BUSY, tmp_path, name="busy.py")
    for instance in (busy, waiting):  # both ran in alice's worker, and both end with it
        kind, message = outcome(c, instance)
        assert kind == "error" and "held its event loop for more than 3 s" in message, message
    kind, value = outcome(*run(pie, "tok-alice", HELLO, tmp_path, name="hello.py"))
    assert kind == "return" and value["uid"] != 0


def test_a_fork_bomb_ends_only_its_users_worker(pie, bob, tmp_path):
    kind, message = outcome(*run(pie, "tok-alice", FORK_BOMB, tmp_path, name="bomb.py"))
    assert kind == "error" and "limit of 48 processes" in message, message


def test_a_memory_blow_up_fails_only_that_instance(pie, bob, tmp_path):
    kind, message = outcome(*run(pie, "tok-alice", MEMORY, tmp_path, name="memory.py"))
    assert kind == "error" and "MemoryError" in message and "2048 MiB" in message, message


def test_users_never_share_a_worker_and_a_user_reuses_hers(pie, tmp_path):
    alice = [outcome(*run(pie, "tok-alice", HELLO, tmp_path, name="hello.py"))[1] for _ in range(2)]
    bob = outcome(*run(pie, "tok-bob", HELLO, tmp_path, name="hello.py"))[1]
    assert alice[0]["uid"] == alice[1]["uid"] != bob["uid"]


def test_health_and_status_show_the_sandbox_and_nothing_leaked(pie):
    assert httpx.get(f"{pie['url']}/healthz").json() == {"status": "ok", "sandbox": "bubblewrap"}
    deadline = time.time() + 30
    while True:  # the market's leave and the replica's close of a killed worker's contexts land within a moment
        status = engine_status(pie)
        replica = status["replicas"][0]
        idle = replica["contexts"] == 0 and status["market"]["wallets"] == status["launcher"]["running"] == 0
        if idle or time.time() > deadline:
            break
        time.sleep(0.5)
    assert replica["contexts"] == 0 and replica["pages_used"] == 0
    assert status["market"]["wallets"] == 0
    assert status["launcher"]["running"] == 0
    assert {node["sandbox"] for node in status["nodes"]} == {"bubblewrap"}
    here = WorkerLimits(SandboxConfig())  # (test_sandbox_limits.py: the mode the README states for this host)
    here.close()
    assert {node["limits"] for node in status["nodes"]} == {here.mode}
