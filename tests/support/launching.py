"""Test helper: driving a cluster's launcher actor directly, as the HTTP app does: upload a program, launch it,
follow its events to the end, and read the replicas' engine stats."""

from __future__ import annotations

import textwrap
import time

import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SupervisionConfig
from pie_cluster.control.status_records import ReplicaStatus
from pie_cluster.hosts.driver_events import poll
from pie_cluster.launch_request import LaunchRequest

HOLD = """
import asyncio
from inferlet import Context, Model, Sampler

async def main(input):
    with Context(Model.load("default")) as ctx:
        ctx.user("hold a context")
        await ctx.generate(Sampler.argmax(), max_tokens=2, stop=[]).collect_tokens()
        await asyncio.sleep(600)
"""
"""An inferlet that holds one live context (the autoscaler's load) until it is aborted."""


def autoscaled_config(downscale_delay_s: float = 1) -> PieConfig:
    """The tiny model autoscaled between 1 and 2 replicas at 2 contexts each, on every reading alone (no load
    window) and with no upscale delay: the tests that drive the scaler with held contexts."""
    model = ModelConfigEntry(
        pages=64, cpus_per_rank=1, min_replicas=1, max_replicas=2, target_load=2, upscale_delay_s=0,
        downscale_delay_s=downscale_delay_s, load_window_s=0,
    )  # fmt: skip
    return PieConfig(auth=AuthConfig(enabled=False), model=[model], supervision=SupervisionConfig(probe_every_s=0.5))


def replica_groups() -> int:
    """Placement groups made (the autoscaled tests count one per replica added beyond the model's own)."""
    return sum(1 for g in ray.util.placement_group_table().values() if g["state"] == "CREATED")


def upload(launcher, source: str, user: str = "alice", filename: str = "prog.py") -> str:
    return ray.get(launcher.upload.remote(user, filename, textwrap.dedent(source).encode())).program


def launch(launcher, program: str, input: dict | None = None, user: str = "alice", **fields) -> str:
    return ray.get(launcher.launch.remote(user, LaunchRequest(program=program, input=input or {}, **fields)))


def run_to_end(launcher, instance_id: str, user: str = "alice", timeout: float = 120) -> list[list]:
    """Every event of the instance, following the stream until its terminal event."""
    events, since, deadline = [], 0, time.time() + timeout
    while time.time() < deadline:
        got = poll(launcher, user, instance_id, since, 5.0)
        events += got.events
        since = got.next_index
        if got.done:
            return events
    raise AssertionError(f"instance {instance_id} did not end in {timeout} s; events so far: {events}")


def engine_stats(cluster) -> list[ReplicaStatus]:
    return ray.get(cluster.status.remote()).replicas


# A greedy generation of 8 tokens; with ``{"save": True}`` it saves its prompt as snapshot "before" and waits for a
# message half way, with ``{"open": True}`` it generates from that snapshot instead: what a test that breaks
# something in the middle checks afterwards (the same tokens, and the snapshot).
SAVES_AND_WAITS = """
from inferlet import Context, Model, Sampler, session

async def main(input):
    model = Model.load("default")
    if input.get("open"):
        ctx = Context.open(model, "before")
        return await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
    ctx = Context(model)
    ctx.user("what outlives a failure?").cue()
    await ctx.flush()
    if input.get("save"):
        ctx.save("before")
        session.send("saved")
        await session.receive()
    return await ctx.generate(Sampler.argmax(), max_tokens=8, stop=[]).collect_tokens()
"""

# A program that generates until it is stopped (subscribed to a topic, so it holds a bus session too), or with
# ``{"how": "raise"}`` raises after its first pass.
LONG = """
from inferlet import Context, Model, Sampler, messaging

async def main(input):
    sub = messaging.subscribe("news")
    model = Model.load("default")
    ctx = Context(model)
    ctx.user("tell me a very long story")
    if input.get("how") == "raise":
        await ctx.flush()
        raise RuntimeError("the inferlet gave up")
    async for step in ctx.generate(Sampler.argmax(), max_tokens=100000, stop=[]):
        await step.execute()
"""
