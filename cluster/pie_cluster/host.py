"""Running an inferlet program: load its ``main``, give it a runtime, await it, and always clean up after it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint, Runtime, SessionIO, install, uninstall

from pie_cluster import stdio
from pie_cluster.programs import Main, Program
from pie_cluster.stdio import Sink


def load_program(path: str | Path) -> Main:
    """The ``async def main(input)`` of a program file or directory (see ``pie_cluster.programs``)."""
    return Program.from_path(path).load_main()


def encode_return(value: Any) -> str:
    """The Return event's payload: strings verbatim, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


async def run_inferlet(
    main: Main,
    input: dict,
    endpoints: dict[str, ModelEndpoint],
    username: str,
    *,
    instance_id: str | None = None,
    bus: Sequence[str] = (),
    io: SessionIO | None = None,
    output: Sink | None = None,
    mcp_servers: Mapping[str, ServerSpec] | None = None,
    market=None,
    endowment: float | None = None,
    token_budget: int | None = None,
) -> Any:
    """Await ``main(input)`` under its own runtime; whatever happens, release what it holds on every replica and
    on the message bus (``bus``: the shard addresses from ``pie_cluster.bus.Bus.addresses()``), and close its
    wallet on ``market`` (the market actor, opened with ``endowment`` credits or its default). ``token_budget``: the
    tokens it may have the model generate; past it, its next pass raises ``TokenBudgetExhausted``.

    ``io`` serves ``inferlet.session``; ``output`` receives what the inferlet prints, ``(stream, text)`` (None: the
    process's own stdout/stderr); ``mcp_servers`` are the MCP servers ``inferlet.mcp`` may connect to."""
    runtime = Runtime(
        username=username,
        instance_id=instance_id or uuid.uuid4().hex,
        endpoints=endpoints,
        bus=tuple(bus),
        io=io,
        mcp_servers=dict(mcp_servers or {}),
        token_budget=token_budget,
    )
    token = install(runtime)
    captured = stdio.capture(output) if output is not None else None
    try:
        if market is not None:
            await market.join.remote(runtime.instance_id, endowment)
        return await main(input)
    finally:
        try:
            runtime.close()
        finally:
            if captured is not None:
                stdio.release(captured)
            uninstall(token)
            if market is not None:  # after its contexts are gone: a later report of them pays nothing
                await asyncio.shield(market.leave.remote(runtime.instance_id))


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
