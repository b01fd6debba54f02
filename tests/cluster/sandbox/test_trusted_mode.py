"""A cluster whose operator turned the sandbox off (``[sandbox] mode = "off"``: every user is trusted): a manifest's
``isolated`` and ``runtime_env`` go to Ray, as a dedicated host actor per instance. With the sandbox on (the default,
``test_launcher.py``) a runtime_env is refused at upload and an isolated program stays on the node's pooled host."""

from __future__ import annotations

import json
import time

import pytest
import ray
from pie_cluster.config import AuthConfig, LimitsConfig, ModelConfigEntry, PieConfig, SandboxConfig
from pie_cluster.control.lifecycle import start_controller
from pie_cluster.hosts.driver_events import poll
from support.launching import launch, run_to_end
from support.program_zips import isolated_shouter, zip_program


@pytest.fixture(scope="module")
def launcher(ray_session):
    model = ModelConfigEntry(pages=64, cpus_per_rank=1, max_batch_tokens=256)
    limits = LimitsConfig(stdout_total_bytes=1 << 20)
    config = PieConfig(auth=AuthConfig(enabled=False), model=[model], sandbox=SandboxConfig(mode="off"), limits=limits)
    controller = start_controller(config, detached=False)
    yield ray.get_actor("pie-launcher")
    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def test_an_isolated_directory_program_runs_in_its_own_process(launcher):
    data = isolated_shouter("getpid")
    isolated = ray.get(launcher.upload.remote("alice", "shouter.zip", data)).program
    pid = b"import os\nasync def main(input):\n    return os.getpid()\n"
    pooled = ray.get(launcher.upload.remote("alice", "pid.py", pid))
    got = json.loads(run_to_end(launcher, launch(launcher, isolated, {"text": "hey"}))[-1][2])
    assert got["text"] == "HEY"
    assert got["process"] != json.loads(run_to_end(launcher, launch(launcher, pooled.program))[-1][2])


def test_a_runtime_env_goes_to_ray_and_a_host_that_cannot_start_ends_the_instance(launcher):
    manifest = """
    [package]
    name = "unbuildable"
    version = "0.1.0"
    [inferlet.runtime_env]
    conda = "pie-test-no-such-env"
    """
    data = zip_program({"pie.toml": manifest, "main.py": "async def main(input):\n    return 'never'\n"})
    program = ray.get(launcher.upload.remote("alice", "unbuildable.zip", data)).program  # accepted when trusted...
    instance = launch(launcher, program)
    (event,) = run_to_end(launcher, instance)  # ...and the instance ends saying why it never ran
    assert event[1] == "error" and "could not start the instance" in event[2] and "runtime env" in event[2]
    assert ray.get(launcher.abort.remote("alice", instance)) is False
    assert ray.get(ray.get_actor("pie-market").summary.remote()).wallets == 0


def test_a_killed_dedicated_host_ends_its_instance_with_an_error(launcher):
    """SIGKILL the dedicated host of a parked isolated instance: the instance ends with an error saying so, and its
    wallet closes (a dedicated host is not restarted: its one instance is lost with it)."""
    import os
    import signal

    main = """
    import os
    from inferlet import session

    async def main(input):
        session.send(str(os.getpid()))
        return await session.receive()
    """
    manifest = '[package]\nname = "parked"\nversion = "0.1.0"\n[inferlet]\nisolated = true\n'
    data = zip_program({"pie.toml": manifest, "main.py": main})
    program = ray.get(launcher.upload.remote("alice", "parked.zip", data)).program
    instance = launch(launcher, program)
    (event,) = poll(launcher, "alice", instance, 0, 60.0).events
    killed = time.monotonic()
    os.kill(int(event[2]), signal.SIGKILL)
    last = run_to_end(launcher, instance)[-1]
    print(f"the instance ended with its dedicated host's death {time.monotonic() - killed:.1f} s after the SIGKILL")
    assert last[1] == "error" and "dedicated inferlet host" in last[2] and "died" in last[2], last
    for _ in range(100):
        if ray.get(ray.get_actor("pie-market").summary.remote()).wallets == 0:
            break
        time.sleep(0.1)
    assert ray.get(ray.get_actor("pie-market").summary.remote()).wallets == 0


OVER_LIMITS = b"""
import asyncio
from inferlet import session

async def main(input):
    if input["send"]:
        session.send("m" * (2 << 20))
    while True:
        print("x" * 10_000)
        await asyncio.sleep(0)
"""


def test_an_in_process_instance_is_held_to_the_same_event_limits(launcher):
    """Without the sandbox, instances run in the host's own process: their events have the same bounds there."""
    program = ray.get(launcher.upload.remote("alice", "over.py", OVER_LIMITS)).program
    for send, limit in [(True, "event_bytes = 1048576"), (False, "stdout_total_bytes = 1048576")]:
        *_, (_, kind, message) = run_to_end(launcher, launch(launcher, program, {"send": send}))
        assert kind == "error" and message.startswith("the instance was ended: ") and f"[limits] {limit}" in message


def test_an_isolated_instance_on_a_dedicated_host_is_held_to_the_configured_limits(launcher):
    """A dedicated host takes the cluster's ``[limits]`` too (here a 1 MiB stdout total), not the defaults."""
    manifest = '[package]\nname = "loud"\nversion = "0.1.0"\n[inferlet]\nisolated = true\n'
    data = zip_program({"pie.toml": manifest, "main.py": OVER_LIMITS.decode()})
    program = ray.get(launcher.upload.remote("alice", "loud.zip", data)).program
    *_, (_, kind, message) = run_to_end(launcher, launch(launcher, program, {"send": False}))
    assert kind == "error" and "[limits] stdout_total_bytes = 1048576" in message, message
