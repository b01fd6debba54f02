"""A host no tenant can stall: alice floods the node's inferlet host while bob's instance on it streams.

A `pie start`ed cluster with the sandbox on and the default ``[limits]``. Bob's instance sends a timestamped message
every 20 ms; the test measures each one's delay at arrival (through the ingress, as a client sees it), first with
nothing else running, then while alice's uploaded programs, on the same host, flood stdout (with prints, and with
raw frames of tiny messages written to her worker's own socket), send messages over the size limit, forge event
kinds and malformed messages. Each of alice's instances ends with an error naming what it broke; bob's messages all
arrive, in order, and their p99 delay stays within 50 ms of its unloaded value (the issue's bound) in every round
of four but at most one: on a shared two-core machine another process's burst can cost any one window that much,
while a host that alice can stall (a loop held per spawned worker, per flood turn) misses it in every round. It
runs with the ``alone`` tests: beside the parallel suite's other session, that session's bursts cost bob's p99 70-87 ms
over its unloaded value in two rounds of four, in a run whose host was not stalled.
The serving path's processes run at nice 0 and tenants' workers at nice 10: at Ray's default of nice 15 for its
workers, one busy ordinary process elsewhere on the machine was enough for alice's floods to cost bob 175-460 ms.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import psutil
import pytest
import ray
from pie_cluster.client import PieClient
from pie_cluster.control.controller import LAUNCHER
from pie_cluster.launch_request import LaunchRequest
from pie_cluster.ray_session import NAMESPACE
from support.pie_procs import started_pie

pytestmark = pytest.mark.alone

PERIOD_S = 0.02
ROUNDS, WINDOW = 4, 200  # bob's messages measured in each window, without then with alice's attacks
BOUND_S = 0.050
SETTLE_S = 2.0  # after an attack, for alice's ended workers to go, before the next unloaded window
TOTAL = "[limits] stdout_total_bytes = 67108864"

BOB = """
import asyncio, itertools, time
from inferlet import session

async def main(input):
    stop = asyncio.ensure_future(session.receive())
    for i in itertools.count():
        if stop.done():
            return "done"
        session.send(f"{i} {time.time()!r}")
        await asyncio.sleep(input["period"])
"""

PRINTS = """
import asyncio
async def main(input):
    line = "x" * 10_000
    while True:
        for _ in range(100):
            print(line)
        await asyncio.sleep(0)
"""

RAW = """
import asyncio, gc, msgpack
from inferlet import runtime

def worker_socket():
    return next(o for o in gc.get_objects() if type(o).__name__ == "FrameWriter")._writer

async def main(input):
    me, sock = runtime.instance_id(), worker_socket()
    if input["send"] == "flood":
        frame = msgpack.packb([["event", me, "stdout", "y" * 64]] * 10_000)
        while True:
            sock.write(frame)
            await sock.drain()
    sock.write(msgpack.packb([[me if part == "me" else part for part in input["send"]]]))
    await asyncio.sleep(60)
"""

HUGE = """
import asyncio
from inferlet import session
async def main(input):
    session.send("m" * (2 << 20))
    await asyncio.sleep(60)
"""

ENDED = "this user's sandboxed worker was ended: it broke the host protocol"


@pytest.fixture(scope="module")
def pie(ray_cluster, tmp_path_factory):
    yield from started_pie(ray_cluster, tmp_path_factory.mktemp("pie-home"))


@pytest.fixture(scope="module")
def head(ray_session):
    """The node both users' instances run on: one host's loop is what they share."""
    return next(n["NodeID"] for n in ray_session.nodes() if n["Alive"] and "second_node" not in n["Resources"])


class Launcher:
    """A user's programs, launched on one node; how an instance ended is asked of the launcher, so that the test's
    own process does not read alice's floods (it measures bob's delays)."""

    def __init__(self, pie, token: str, user: str, node: str, directory, sources: list[str]):
        self.client, self.user, self.node = PieClient(pie["url"], token), user, node
        self._programs = {}
        for i, source in enumerate(sources):
            (directory / f"{user}{i}.py").write_text(source)
            self._programs[source] = self.client.upload(directory / f"{user}{i}.py")["program"]

    def launch(self, source: str, input: dict | None = None) -> str:
        request = LaunchRequest(program=self._programs[source], input=input or {}, node_id=self.node)
        return self.client.launch(request)

    def ending(self, instance: str) -> tuple[str, object]:
        launcher = ray.get_actor(LAUNCHER, namespace=NAMESPACE)
        while (where := ray.get(launcher.locate.remote(self.user, instance, 0.0), timeout=60)).ending is None:
            time.sleep(0.2)
        return where.ending

    def run(self, source: str, input: dict | None = None) -> tuple[str, object]:
        return self.ending(self.launch(source, input))


class Floods:
    """Alice's floods, each relaunched as soon as it ends, until ``stop`` aborts them."""

    def __init__(self, alice: Launcher):
        self._alice, self._stopping, self._running = alice, threading.Event(), {}
        self.endings: list[tuple[str, object]] = []
        flooding = [("prints", PRINTS, None), ("raw", RAW, {"send": "flood"})]
        self._threads = [threading.Thread(target=self._flood, args=args) for args in flooding]
        for thread in self._threads:
            thread.start()

    def _flood(self, name: str, source: str, input: dict | None) -> None:
        while not self._stopping.is_set():
            self._running[name] = self._alice.launch(source, input)
            self.endings.append(self._alice.ending(self._running[name]))

    def stop(self) -> None:
        self._stopping.set()
        while any(thread.is_alive() for thread in self._threads):
            for instance in list(self._running.values()):
                self._alice.client.abort(instance)
            for thread in self._threads:
                thread.join(timeout=1)


def priorities(marker: str) -> set[int]:
    """The nice values of this cluster's processes whose command line has an argument starting with ``marker``: its
    live actors' processes and what they started (another test session's cluster on this machine is not this one)."""
    from ray.util.state import list_actors

    ours = {a["pid"] for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)}
    found = set()
    for process in psutil.process_iter(["cmdline", "nice"]):
        with contextlib.suppress(psutil.Error):
            if any(arg.startswith(marker) for arg in process.info["cmdline"] or ()) and (
                process.pid in ours or any(parent.pid in ours for parent in process.parents())
            ):
                found.add(process.info["nice"])
    return found


def p99(delays: list[float]) -> float:
    ordered = sorted(delays)
    return ordered[int(0.99 * (len(ordered) - 1))]


def test_alices_floods_and_forgeries_neither_stall_the_host_nor_cost_bob_an_event(pie, head, tmp_path):
    bob = Launcher(pie, "tok-bob", "bob", head, tmp_path, [BOB])
    alice = Launcher(pie, "tok-alice", "alice", head, tmp_path, [PRINTS, RAW, HUGE])
    streaming = bob.launch(BOB, {"period": PERIOD_S})
    arrivals: list[tuple[int, float, float]] = []  # (index, sent at, arrived at)
    ending: list = []

    def follow() -> None:
        for _, kind, value in bob.client.events(streaming):
            if kind != "message":
                ending.append((kind, value))
                return
            index, sent = value.split()
            arrivals.append((int(index), float(sent), time.time()))

    def delays_while(work) -> list[float]:
        """Bob's delays of the messages he sent while ``work()`` ran (it returns once enough were measured)."""
        since = time.time()
        work(lambda: sum(sent > since for _, sent, _ in arrivals) >= WINDOW)
        until = time.time()
        return [arrived - sent for _, sent, arrived in arrivals if since < sent < until]

    def idle(measured) -> None:
        while not measured():
            time.sleep(0.05)

    forged: list[tuple[str, object]] = []
    floods_ended: list[tuple[str, object]] = []

    def attack(measured) -> None:
        floods = Floods(alice)
        forged.append(alice.run(RAW, {"send": ["event", "me", "pwned", "?"]}))
        forged.append(alice.run(RAW, {"send": ["pong"]}))
        forged.append(alice.run(HUGE))
        idle(measured)
        floods.stop()
        floods_ended.extend(floods.endings)

    threading.Thread(target=follow, daemon=True).start()
    while len(arrivals) < 20:  # these warm the path
        time.sleep(0.1)
    # The serving path runs at the CPU priority of an ordinary process, not Ray's default of nice 15 for workers,
    # and tenants' code 10 steps below it.
    for title in ("ray::InferletHost", "ray::ServeReplica", "ray::ProxyActor"):
        assert priorities(title) == {0}, title
    assert priorities("pie_cluster.hosts.sandbox.worker_main") == {10}
    rounds = []
    for _ in range(ROUNDS):  # alternated, so that both see the machine's other load alike
        time.sleep(SETTLE_S)
        rounds.append((p99(delays_while(idle)), p99(delays_while(attack))))
    shown = ", ".join(f"{quiet * 1e3:.1f} -> {loaded * 1e3:.1f} ms" for quiet, loaded in rounds)
    print(f"bob's delay p99 per round, unloaded -> under attack: {shown}")
    within = [loaded <= quiet + BOUND_S for quiet, loaded in rounds]
    assert sum(within) >= ROUNDS - 1, shown  # one round may meet a stall of the machine's, not the host's

    assert alice.run(PRINTS)[1] == f"the instance was ended: its output went over {TOTAL}"
    reasons = ["unknown event kind 'pwned'", "'pong' with ()", "[limits] event_bytes = 1048576"]
    for (kind, message), expected in zip(forged, itertools.cycle(reasons)):
        assert kind == "error" and expected in message, (expected, message)
    for kind, message in floods_ended:  # at their total, with the worker a forgery ended, or by the test
        assert kind == "error" and (TOTAL in message or ENDED in message or message == "aborted by its user"), message

    bob.client.send(streaming, "stop")
    deadline = time.time() + 60
    while not ending and time.time() < deadline:
        time.sleep(0.1)
    assert ending == [("return", "done")]
    assert [index for index, _, _ in arrivals] == list(range(len(arrivals)))  # none lost, none reordered
