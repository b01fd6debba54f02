"""An inferlet that keeps an autoscaled node busy: ``bench/elastic.py --smoke`` runs one on the node its second
replica came for, holding a context there, while the load goes away.

Removing that replica hands the context over to the first (its KV moves), and the node gives its inferlet host back
only once the inferlet has ended: until it is told to finish, the node must stay. Told, it generates on from the
moved context and returns its tokens with what its link did, to compare with the same program run unmoved.
"""

from __future__ import annotations

import json
import textwrap
import time
from dataclasses import dataclass

import ray
from pie_cluster.hosts.driver_events import poll
from pie_cluster.launch_request import LaunchRequest

USER = "bench"
PROGRAM = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    model = Model.load("default")
    with Context(model) as ctx:
        ctx.user("an inferlet that outlives its replica").cue()
        tokens = await ctx.generate(Sampler.argmax(), max_tokens=4, stop=[]).collect_tokens()
        if input.get("hold"):
            session.send("holding")
            await session.receive()
        tokens += await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
    return {"tokens": tokens, "moves": model.link.moves, "transferred": model.link.transferred}
"""


@dataclass
class Pinned:
    """The held inferlet's story: whether its node stayed while it ran, and what it returned."""

    node: str
    instance: str
    kept_node: bool = False  # its node was neither released nor removed while it held its context
    result: dict | None = None
    unmoved: dict | None = None  # the same program, run through without holding


def launch(launcher, node: str | None, hold: bool) -> str:
    program = ray.get(launcher.upload.remote(USER, "pinned.py", textwrap.dedent(PROGRAM).encode())).program
    return ray.get(launcher.launch.remote(USER, LaunchRequest(program=program, input={"hold": hold}, node_id=node)))


def events_until(launcher, instance: str, kind: str, timeout_s: float = 120) -> list:
    """The instance's events up to the first of ``kind`` (or its end)."""
    events, since, deadline = [], 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = poll(launcher, USER, instance, since, 2.0)
        events += got.events
        since = got.next_index
        if got.done or any(e[1] == kind for e in events):
            return events
    raise TimeoutError(f"no {kind!r} event from {instance} within {timeout_s} s: {events}")


def returned(launcher, instance: str) -> dict:
    last = events_until(launcher, instance, "return")[-1]
    if last[1] != "return":
        raise RuntimeError(f"the pinned inferlet ended with {last}")
    return json.loads(last[2])


def tell(launcher, instance: str) -> None:
    host = ray.get(launcher.locate.remote(USER, instance)).host
    ray.get(host.send.remote(USER, instance, "message", "finish"))
