"""Running an inferlet program: load its ``main``, give it a runtime, await it, and always clean up after it."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from inferlet.runtime import ModelEndpoint, Runtime, install, uninstall


class ProgramError(ValueError):
    """The program file cannot be run as an inferlet."""


def load_program(path: str | Path) -> Callable[[dict], Awaitable[Any]]:
    """Import a single-file inferlet and return its ``async def main(input)``."""
    path = Path(path)
    if not path.is_file():
        raise ProgramError(f"{path}: no such program file")
    spec = importlib.util.spec_from_file_location(f"inferlet_program_{uuid.uuid4().hex[:8]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if main is None or not inspect.iscoroutinefunction(main):
        raise ProgramError(f"{path}: an inferlet defines `async def main(input)` at top level")
    return main


def encode_return(value: Any) -> str:
    """The Return event's payload: strings verbatim, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


async def run_inferlet(
    main: Callable[[dict], Awaitable[Any]],
    input: dict,
    endpoints: dict[str, ModelEndpoint],
    username: str,
    relay_stdout: bool = True,
) -> Any:
    """Await ``main(input)`` under its own runtime; whatever happens, release what it holds on every replica."""
    runtime = Runtime(username=username, instance_id=uuid.uuid4().hex, endpoints=endpoints)
    token = install(runtime)
    sink = contextlib.nullcontext() if relay_stdout else contextlib.redirect_stdout(io.StringIO())
    try:
        with sink:
            return await main(input)
    finally:
        runtime.close()
        uninstall(token)


def endpoints_for(name: str, replica) -> dict[str, ModelEndpoint]:
    """Endpoints of one replica started in this process' Ray session (same node: the ipc address)."""
    info = replica.info
    return {
        name: ModelEndpoint(
            name=name,
            address=replica.addresses["ipc"],
            model_dir=info.model_dir,
            page_size=info.page_size,
            vocab_size=info.vocab_size,
            architecture=info.architecture,
        )
    }
