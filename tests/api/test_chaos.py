"""Chaos: every part of a started cluster killed in turn (SIGKILL of its real process) while inferlets run.

One cluster as `pie start` makes it (restartable controller, two replicas of the model on two nodes, sandboxed
hosts, HTTP through Ray Serve) and a steady load: clients that each stream one uploaded inferlet after another over
HTTP, every inferlet doing a bus round trip and a greedy generation. Each test kills one kind of part and measures
how long until a fresh request is served again; the load goes on throughout. Every request of the load must end
(none hangs), as a return or an error that names what happened; at the end no admission slot, page, context,
wallet or subscription is left over. The GCS (its own Ray cluster with Redis), a tensor-parallel follower and a
dedicated host have their own kill tests (`test_gcs_fault_tolerance`, `test_rank_failures`, `test_hung_parts`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from ray.util.state import list_actors
from support.pie_procs import engine_status, started_pie
from test_event_path import sse_events

ALICE = {"Authorization": "Bearer tok-alice"}
SERVED_AGAIN_S = 120  # the bound each recovery is checked against (the measured times are printed)
CLIENTS = 3

LOAD = b"""
from inferlet import Context, Model, Sampler, messaging

async def main(input):
    messaging.push(input["topic"], "ping")
    heard = await messaging.pull(input["topic"])
    ctx = Context(Model.load("default"))
    ctx.user(input["prompt"]).cue()
    tokens = await ctx.generate(Sampler.argmax(), max_tokens=16, stop=[]).collect_tokens()
    return f"{heard} {len(tokens)}"
"""


@dataclass
class Load:
    """Clients streaming one inferlet after another until stopped; how each request ended."""

    url: str
    program: str
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (kind, detail): return / error / broken
    stopping: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for client in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(client,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(SERVED_AGAIN_S)
            assert not thread.is_alive(), "a request of the load never ended"

    def _client(self, client: int) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            outcome = run_one(self.url, self.program, f"c{client}-{n}")
            self.outcomes.append(outcome)
            if outcome[0] == "broken":  # e.g. the proxy is down: no use hammering it
                time.sleep(0.5)


def run_one(url: str, program: str, name: str) -> tuple[str, str]:
    """Stream one instance to its end: ("return", value), ("error", message) or ("broken", why the HTTP call
    failed: its connection or its replica lost, or refused while a part restarts)."""
    body = {"program": program, "input": {"topic": f"load-{name}", "prompt": f"request {name}"}}
    try:
        with httpx.stream(
            "POST", f"{url}/v1/instances?stream=true", json=body, headers=ALICE, timeout=SERVED_AGAIN_S
        ) as got:
            if got.status_code != 200:
                return "broken", f"HTTP {got.status_code}: {got.read().decode(errors='replace')[:200]}"
            events = sse_events(got)
    except httpx.HTTPError as e:
        return "broken", f"{type(e).__name__}: {e}"
    ends = [(kind, str(value)) for kind, value in events if kind in ("return", "error")]
    return ends[-1] if ends else ("broken", f"the stream ended without an ending event after {len(events)} events")


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    supervision = "[supervision]\nprobe_every_s = 1.0\nprobe_deadline_s = 3.0\nmisses = 2\n"
    model = 'replicas = 2\nplacement = "strict_spread"'
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-chaos"), extra_config=supervision, model=model)


@pytest.fixture(scope="module")
def load(pie):
    upload = httpx.post(f"{pie['url']}/v1/programs?filename=load.py", content=LOAD, headers=ALICE, timeout=60)
    assert upload.status_code == 200, upload.text
    load = Load(pie["url"], upload.json()["program"])
    assert run_one(load.url, load.program, "warm-up") == ("return", "ping 16")
    load.start()
    yield load
    load.stop()


RECOVERED: dict[str, float] = {}


def alive(**match) -> list[dict]:
    actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10_000)
    return [a for a in actors if all(str(a.get(k, "")).startswith(v) for k, v in match.items())]


def pids_of(kind: str, pie: dict) -> list[int]:
    """The processes to kill for ``kind`` (one part; both Serve proxies of the one-machine test cluster)."""
    if kind == "model replica":
        return [engine_status(pie)["replicas"][0]["pids"][0]]
    match = {
        "controller": {"class_name": "Controller"},
        "launcher": {"class_name": "Launcher"},
        "market": {"class_name": "MarketActor"},
        "user directory": {"class_name": "UserDirectory"},
        "bus shard 0": {"name": "pie-bus-0"},
        "bus shard 1": {"name": "pie-bus-1"},
        "inferlet host": {"class_name": "InferletHost"},
        "Serve ingress replica": {"class_name": "ServeReplica:"},
        "Serve proxy": {"class_name": "ProxyActor"},
    }[kind]
    found = alive(**match)
    assert found, f"no live actor of kind {kind!r}"
    return [a["pid"] for a in found] if kind == "Serve proxy" else [found[0]["pid"]]


KINDS = [
    "controller",
    "launcher",
    "market",
    "user directory",
    "bus shard 0",
    "bus shard 1",
    "model replica",
    "inferlet host",
    "Serve ingress replica",
    "Serve proxy",
]


@pytest.mark.parametrize("kind", KINDS)
def test_the_cluster_serves_again_after_a_part_is_killed_under_load(pie, load, kind):
    time.sleep(1.0)  # the load has requests under way
    before = len(load.outcomes)
    for pid in pids_of(kind, pie):
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        outcome = run_one(pie["url"], load.program, f"probe-{kind.replace(' ', '-')}")
        if outcome == ("return", "ping 16"):
            break
        assert time.monotonic() - killed < SERVED_AGAIN_S, f"not served again within {SERVED_AGAIN_S} s: {outcome}"
        time.sleep(0.25)
    RECOVERED[kind] = time.monotonic() - killed
    print(f"{kind}: served again {RECOVERED[kind]:.1f} s after its SIGKILL")
    # the load's own requests end too, within the same bound: a fresh probe can be served before the requests the
    # kill caught have waited out their calls to the dead part
    while len(load.outcomes) == before and not kind.startswith("Serve") and time.monotonic() - killed < SERVED_AGAIN_S:
        time.sleep(0.25)
    assert len(load.outcomes) > before or kind.startswith("Serve"), "the load made no progress"


def test_after_the_chaos_every_request_ended_and_nothing_leaked(pie, load):
    """Last: stop the load; every request ended (Load.stop), those that failed said why, and once they are all
    over nothing of theirs is held anywhere."""
    load.stop()
    kinds = {kind for kind, _ in load.outcomes}
    print(f"load: {len(load.outcomes)} requests, {sum(k == 'return' for k, _ in load.outcomes)} returned")
    print("recovery (s): " + ", ".join(f"{kind} {s:.1f}" for kind, s in RECOVERED.items()))
    ended: dict[str, int] = {}
    for kind, detail in load.outcomes:
        if kind != "return":
            ended[f"{kind}: {detail[:70]}"] = ended.get(f"{kind}: {detail[:70]}", 0) + 1
    print("\n".join(f"  {count} x {what}" for what, count in sorted(ended.items(), key=lambda e: -e[1])))
    assert kinds <= {"return", "error", "broken"}
    assert all(detail == "ping 16" for kind, detail in load.outcomes if kind == "return")
    assert all(len(detail) > 10 for kind, detail in load.outcomes if kind != "return"), load.outcomes
    deadline = time.monotonic() + 60
    while True:
        status = engine_status(pie)
        held = {
            "admission": (status["launcher"]["running"], status["launcher"]["queued"]),
            "replicas": [(r["state"], r["contexts"], r["pages_used"]) for r in status["replicas"]],
            "bus": {k: status["bus"][k] for k in ("subscriptions", "waiters", "sessions")},
            "wallets": status["market"]["wallets"],
        }
        clean = {
            "admission": (0, 0),
            "replicas": [("serving", 0, 0)] * 2,
            "bus": {"subscriptions": 0, "waiters": 0, "sessions": 0},
            "wallets": 0,
        }
        if held == clean:
            break
        assert time.monotonic() < deadline, held
        time.sleep(1.0)
    assert status["market"]["balanced"]
