"""Uploading inferlets to the bench cluster's launcher and following them to their end, without HTTP.

Every measurement of bench/cluster.py launches its inferlets through these (the launch latency also over HTTP).
"""

from __future__ import annotations

import asyncio
import io
import json
import textwrap
import zipfile

import ray
from pie_cluster.hosts.events import TERMINAL, follow

DEADLINE_S = 300.0
USER = "bench"


def isolated_manifest(name: str) -> str:
    """The pie.toml of a directory program that runs in a host process of its own."""
    return f'[package]\nname = "{name}"\nversion = "0.1.0"\n[inferlet]\nentry = "main.py"\nisolated = true\n'


def isolated_zip(name: str, source: str) -> bytes:
    """A directory program (pie.toml + main.py) with ``isolated = true``, zipped as the client uploads it."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("pie.toml", isolated_manifest(name))
        archive.writestr("main.py", textwrap.dedent(source))
    return buf.getvalue()


def upload(launcher, source: str, isolated: bool = False, name: str = "prog", user: str = USER) -> str:
    """The program id; only ``user`` can launch it (programs belong to the user who uploaded them)."""
    if isolated:
        return ray.get(launcher.upload.remote(user, f"{name}.zip", isolated_zip(name, source))).program
    return ray.get(launcher.upload.remote(user, f"{name}.py", textwrap.dedent(source).encode())).program


def run_to_end(launcher, user: str, instance_id: str, timeout: float = DEADLINE_S) -> tuple[str, str]:
    """Follow the instance's events to its terminal one: (kind, value)."""

    async def terminal() -> tuple[str, str]:
        async for events in follow(launcher, user, instance_id, wait=10.0):
            for _, kind, value in events:
                if kind in TERMINAL:
                    return kind, value
        raise RuntimeError(f"instance {instance_id} ended without a terminal event")

    try:
        return asyncio.run(asyncio.wait_for(terminal(), timeout))
    except TimeoutError:
        raise TimeoutError(f"instance {instance_id} did not end within {timeout:g} s") from None


def returned(launcher, user: str, instance_id: str):
    """What the instance returned, decoded from JSON; raises if it failed."""
    kind, value = run_to_end(launcher, user, instance_id)
    if kind != "return":
        raise RuntimeError(f"instance {instance_id} failed: {value}")
    return json.loads(value)
