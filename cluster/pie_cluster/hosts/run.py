"""Running an inferlet program: load its ``main``, give it a runtime, await it, and always clean up after it."""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint, Runtime, SessionIO, install, uninstall

from pie_cluster.hosts import stdio
from pie_cluster.hosts.stdio import Sink
from pie_cluster.hosts.wallet_calls import wallet_calls
from pie_cluster.instance import InstanceSetup
from pie_cluster.programs.program import Main, Program, ProgramError

log = logging.getLogger(__name__)

_running: dict[str, Runtime] = {}  # instance id -> runtime, of the inferlets running in this process


def move_bus(addresses: Sequence[str]) -> None:
    """The bus shards listen at ``addresses`` now (one whose node was lost was made again elsewhere): the inferlets
    running in this process connect there (sandboxed ones reach shards through relays that follow them)."""
    for runtime in list(_running.values()):
        runtime.move_bus(tuple(addresses))


def load_program(path: str | Path) -> Main:
    """The ``async def main(input)`` of a program file or directory (see ``pie_cluster.programs.program``)."""
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
    instance_id: str,
    capability: str,
    bus: Sequence[str] = (),
    io: SessionIO | None = None,
    output: Sink | None = None,
    mcp_servers: Mapping[str, ServerSpec] | None = None,
    market=None,
    endowment: float | None = None,
    token_budget: int | None = None,
    opening_balance: float | None = None,
) -> Any:
    """Await ``main(input)`` as instance ``instance_id`` of ``username``, proven to replicas and bus shards by
    ``capability`` (minted for them by the trusted side); whatever happens, release what it holds on every replica and
    on the message bus (``bus``: the shard addresses from ``pie_cluster.bus.Bus.addresses()``), and close its
    wallet on ``market`` (the market actor, opened with ``endowment`` credits or its default). ``token_budget``: the
    tokens it may have the model generate; past it, its next pass raises ``TokenBudgetExhausted``.
    ``opening_balance``: the credits of the wallet its host opened for it already (``market`` then only closes it).

    ``io`` serves ``inferlet.session``; ``output`` receives what the inferlet prints, ``(stream, text)`` (None: the
    process's own stdout/stderr); ``mcp_servers`` are the MCP servers ``inferlet.mcp`` may connect to."""
    runtime = Runtime(
        username=username,
        instance_id=instance_id,
        endpoints=endpoints,
        capability=capability,
        bus=tuple(bus),
        io=io,
        mcp_servers=dict(mcp_servers or {}),
        token_budget=token_budget,
    )
    token = install(runtime)
    _running[runtime.instance_id] = runtime
    captured = stdio.capture(output) if output is not None else None
    try:
        if market is not None and opening_balance is None:  # (given: its host opened it already)
            opening_balance = await wallet_calls(market).join(runtime.instance_id, endowment)
        if opening_balance is not None:
            runtime.wallet_opened(opening_balance)
        return await main(input)
    finally:
        _running.pop(runtime.instance_id, None)
        try:
            await runtime.aclose()
        finally:
            if captured is not None:
                stdio.release(captured)
            uninstall(token)
            if market is not None:  # after its contexts are gone: a later report of them pays nothing
                # a market that cannot close the wallet now (restarting) must not fail an instance that finished;
                # Ray's errors are caught as any (this module is imported in sandboxed workers, which have no Ray)
                try:
                    await asyncio.shield(wallet_calls(market).leave(runtime.instance_id))
                except Exception as e:
                    log.warning("the market did not close the wallet of %s: %s", runtime.instance_id, e)


Emit = Callable[[str, "str | bytes"], None]  # (event kind, value) of one instance


async def serve_instance(
    program: Program,
    main: Callable[[], Main],
    input: dict,
    setup: InstanceSetup,
    emit: Emit,
    io: SessionIO | None,
    aborted: Callable[[], str],
    market=None,
) -> None:
    """Run one instance to its end; its last event is ``return`` or an ``error`` that says why (``aborted()``: the
    reason it was cancelled). ``main`` loads the program's entry point (errors there are the program's). Its wallet
    opens on ``market`` with ``setup.limits.endowment``, unless ``setup.opening_balance`` says its host opened it."""
    try:
        async with asyncio.timeout(setup.limits.deadline_s) as deadline:
            result = await run_inferlet(
                main(),
                input,
                setup.endpoints,
                setup.username,
                instance_id=setup.instance_id,
                capability=setup.capability,
                bus=setup.bus,
                io=io,
                output=emit,
                mcp_servers=setup.mcp_servers,
                market=market,
                endowment=setup.limits.endowment,
                token_budget=setup.limits.token_budget,
                opening_balance=setup.opening_balance,
            )
        emit("return", encode_return(result))
    except asyncio.CancelledError:
        emit("error", aborted())
    except TimeoutError as e:
        if setup.limits.deadline_s is not None and deadline.expired():
            emit("error", f"deadline exceeded: the instance ran for more than {setup.limits.deadline_s:g} s")
        else:
            emit("error", describe_error(e, program))
    except ProgramError as e:
        emit("error", str(e))
    except Exception as e:
        emit("error", describe_error(e, program))


def describe_error(error: BaseException, program: Program) -> str:
    """``Type: message`` plus where in the program it was raised (the host's own frames are noise to the user)."""
    where = [
        f"{frame.filename.split('/', 1)[-1]} line {frame.lineno}, in {frame.name}"
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename.startswith(f"<{program.label}>")
    ]
    text = f"{type(error).__name__}: {error}"
    return f"{text} (at {where[-1]})" if where else text


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
