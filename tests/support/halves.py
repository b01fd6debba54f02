"""Test helper for the failover tests: an inferlet that stops half way through a greedy generation until its
client says go on, and running many of them with a kill in the middle."""

from __future__ import annotations

import json
import time

import ray
from pie_cluster.hosts.driver_events import poll
from support.launching import launch, run_to_end

HALVES = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    model = Model.load(input["model"])
    ctx = Context(model)
    ctx.user(input["prompt"]).cue()
    tokens = await ctx.generate(Sampler.argmax(), max_tokens=12, stop=[]).collect_tokens()
    if input.get("wait"):
        session.send("half way")
        await session.receive()
    async for step in ctx.generate(Sampler.argmax(), max_tokens=12, stop=[]):
        tokens += (await step.execute()).tokens
    return {"tokens": tokens, "moves": model.link.moves}
"""


def run_halves(launcher, program: str, model: str, node: str, kill=None, count: int = 32) -> list[dict]:
    """Run ``count`` instances on ``node``, each with its own prompt; with ``kill``, they wait half way until it
    has run. Returns each one's result."""
    inputs = [{"model": model, "prompt": f"story {i}", "wait": kill is not None} for i in range(count)]
    instances = [launch(launcher, program, input, node_id=node) for input in inputs]
    if kill is not None:
        for instance in instances:
            wait_for_message(launcher, instance)
        kill()
        killed = time.monotonic()
        for instance in instances:
            host = ray.get(launcher.locate.remote("alice", instance)).host
            ray.get(host.send.remote("alice", instance, "message", "go on"))
    results = []
    for instance in instances:
        last = run_to_end(launcher, instance)[-1]
        assert last[1] == "return", last
        results.append(json.loads(last[2]))
    if kill is not None:
        print(f"{model}: {count} instances finished {time.monotonic() - killed:.1f} s after the kill")
    return results


def wait_for_message(launcher, instance: str, bound_s: float = 120) -> None:
    since, deadline = 0, time.monotonic() + bound_s
    while time.monotonic() < deadline:
        got = poll(launcher, "alice", instance, since, 2.0)
        kinds = [e[1] for e in got.events]
        assert "error" not in kinds and "return" not in kinds, got.events
        if "message" in kinds:
            return
        since = got.next_index
    raise AssertionError(f"instance {instance} sent nothing within {bound_s} s")
