"""A cluster whose operator turned the sandbox off (``[sandbox] mode = "off"``: every user is trusted): a manifest's
``isolated`` and ``runtime_env`` go to Ray, as a dedicated host actor per instance. With the sandbox on (the default,
tests/test_cluster.py) a runtime_env is refused at upload and an isolated program stays on the node's pooled host."""

from __future__ import annotations

import json
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, ModelConfigEntry, PieConfig, SandboxConfig
from pie_cluster.controller import start_controller
from pie_cluster.launch_request import LaunchRequest
from program_zips import isolated_shouter, zip_program


@pytest.fixture(scope="module")
def launcher(ray_session):
    model = ModelConfigEntry(pages=64, cpus_per_rank=1, max_batch_tokens=256)
    config = PieConfig(auth=AuthConfig(enabled=False), model=[model], sandbox=SandboxConfig(mode="off"))
    controller = start_controller(config, detached=False)
    yield ray.get_actor("pie-launcher")
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def launch(launcher, program: str, input: dict | None = None) -> str:
    return ray.get(launcher.launch.remote("alice", LaunchRequest(program=program, input=input or {})))


def run_to_end(launcher, instance: str, timeout: float = 120) -> list[list]:
    """Every event of alice's instance, following the stream until its terminal event."""
    events, since, deadline = [], 0, time.time() + timeout
    while time.time() < deadline:
        got = ray.get(launcher.events.remote("alice", instance, since, 5.0))
        events += got["events"]
        since = got["next"]
        if got["done"]:
            return events
    raise AssertionError(f"instance {instance} did not end in {timeout} s; events so far: {events}")


def test_an_isolated_directory_program_runs_in_its_own_process(launcher):
    data = isolated_shouter("getpid")
    isolated = ray.get(launcher.upload.remote("alice", "shouter.zip", data))["program"]
    pid = b"import os\nasync def main(input):\n    return os.getpid()\n"
    pooled = ray.get(launcher.upload.remote("alice", "pid.py", pid))
    got = json.loads(run_to_end(launcher, launch(launcher, isolated, {"text": "hey"}))[-1][2])
    assert got["text"] == "HEY"
    assert got["process"] != json.loads(run_to_end(launcher, launch(launcher, pooled["program"]))[-1][2])


def test_a_runtime_env_goes_to_ray_and_a_host_that_cannot_start_ends_the_instance(launcher):
    manifest = """
    [package]
    name = "unbuildable"
    version = "0.1.0"
    [inferlet.runtime_env]
    conda = "pie-test-no-such-env"
    """
    data = zip_program({"pie.toml": manifest, "main.py": "async def main(input):\n    return 'never'\n"})
    program = ray.get(launcher.upload.remote("alice", "unbuildable.zip", data))["program"]  # accepted when trusted...
    instance = launch(launcher, program)
    (event,) = run_to_end(launcher, instance)  # ...and the instance ends saying why it never ran
    assert event[1] == "error" and "could not start the instance" in event[2] and "runtime env" in event[2]
    assert ray.get(launcher.abort.remote("alice", instance)) is False
    assert ray.get(ray.get_actor("pie-market").summary.remote())["wallets"] == 0
