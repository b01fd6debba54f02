"""Where inferlets run: an async Ray actor that hosts many inferlet instances as asyncio tasks.

Each node gets one pooled host (launching there costs an actor call, not a process: hundreds of inferlets share
one interpreter, each with its own runtime, stdout and session); a program that asks for isolation or its own
``runtime_env`` gets a dedicated host of its own, killed when it ends. Everything an instance produces goes to the
launcher as events, batched per event-loop turn into one actor call.
"""

from __future__ import annotations

import asyncio
import gc
import traceback
from dataclasses import dataclass, field

from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint

from pie_cluster import stdio
from pie_cluster.host import encode_return, run_inferlet
from pie_cluster.model_files import local_endpoints
from pie_cluster.programs import Program, ProgramError


class _ClientSession:
    """``inferlet.session`` for a hosted instance: events out through the host, inbound through the launcher."""

    def __init__(self, host: InferletHost, instance_id: str):
        self._host, self._id = host, instance_id

    def send(self, text: str) -> None:
        self._host.emit(self._id, "message", text)

    def send_file(self, data: bytes) -> None:
        self._host.emit(self._id, "file", data)

    async def receive(self) -> str:
        return await self._host.launcher.receive.remote(self._id, "message")

    async def receive_file(self) -> bytes:
        return await self._host.launcher.receive.remote(self._id, "file")


@dataclass(frozen=True)
class NodeServices:
    """What an inferlet on one node reaches; fixed while the cluster runs, so a host gets it once."""

    endpoints: dict[str, ModelEndpoint]  # model name -> a replica (ipc on this node, else tcp)
    bus: tuple[str, ...] = ()  # message bus shard addresses from this node
    mcp_servers: dict[str, ServerSpec] = field(default_factory=dict)  # name -> how inferlets reach it
    market: object | None = None  # the KV-page market actor: every instance has a wallet there while it runs
    model_files: dict[str, object] = field(default_factory=dict)  # model name -> Ray ref to its tokenizer files


@dataclass(frozen=True)
class InstanceLimits:
    """What an instance may use: wall time, market credits, generated tokens (None: the cluster's default)."""

    deadline_s: float | None = None
    endowment: float | None = None
    token_budget: int | None = None


class InferletHost:
    def __init__(self, launcher, services: NodeServices):
        self.launcher = launcher
        self.services = services
        self._endpoints: dict[str, ModelEndpoint] | None = None  # services.endpoints as seen from this node
        self._tasks: dict[str, asyncio.Task] = {}
        self._abort_reasons: dict[str, str] = {}
        self._outbox: list[tuple[str, str, str | bytes]] = []
        stdio.install_router()
        gc.freeze()  # the imports live as long as the host: full collections need not scan them (see RankWorker.start)

    async def ready(self) -> bool:
        """Answers as soon as the host is up (``pie status`` asks it)."""
        return True

    async def set_services(self, services: NodeServices) -> None:
        """What new instances reach from now on (a replica was replaced: its addresses changed)."""
        self.services, self._endpoints = services, None

    async def lifetime(self) -> None:
        """Never answers: the launcher keeps this call open to learn at once that the host died (it fails)."""
        await asyncio.Event().wait()

    async def start(
        self, instance_id: str, program: Program, input: dict, username: str, limits: InstanceLimits
    ) -> None:
        """Begin running the instance; returns at once (its events report how it goes)."""
        task = asyncio.get_running_loop().create_task(self._run(instance_id, program, input, username, limits))
        self._tasks[instance_id] = task

    async def abort(self, instance_id: str, reason: str = "aborted") -> bool:
        task = self._tasks.get(instance_id)
        if task is None or task.done():
            return False
        self._abort_reasons[instance_id] = reason
        task.cancel()
        return True

    # -- one instance ------------------------------------------------------------------------------------------

    async def _run(self, instance_id: str, program: Program, input: dict, username: str, limits: InstanceLimits):
        def output(stream: str, text: str) -> None:
            self.emit(instance_id, stream, text)

        try:
            main = program.load_main()
            services = self.services
            if self._endpoints is None:
                self._endpoints = await local_endpoints(services.endpoints, services.model_files)
            async with asyncio.timeout(limits.deadline_s) as deadline:
                result = await run_inferlet(
                    main,
                    input,
                    self._endpoints,
                    username,
                    instance_id=instance_id,
                    bus=services.bus,
                    io=_ClientSession(self, instance_id),
                    output=output,
                    mcp_servers=services.mcp_servers,
                    market=services.market,
                    endowment=limits.endowment,
                    token_budget=limits.token_budget,
                )
            self.emit(instance_id, "return", encode_return(result))
        except asyncio.CancelledError:
            self.emit(instance_id, "error", self._abort_reasons.pop(instance_id, "aborted"))
        except TimeoutError as e:
            if limits.deadline_s is not None and deadline.expired():
                message = f"deadline exceeded: the instance ran for more than {limits.deadline_s:g} s"
                self.emit(instance_id, "error", message)
            else:
                self.emit(instance_id, "error", _describe(e, program))
        except ProgramError as e:
            self.emit(instance_id, "error", str(e))
        except Exception as e:
            self.emit(instance_id, "error", _describe(e, program))
        finally:
            self._tasks.pop(instance_id, None)

    def emit(self, instance_id: str, kind: str, value: str | bytes) -> None:
        """Queue an event for this loop turn's batch; consecutive writes to one stream merge into one event."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        elif kind in ("stdout", "stderr") and self._outbox[-1][:2] == (instance_id, kind):
            self._outbox[-1] = (instance_id, kind, self._outbox[-1][2] + value)
            return
        self._outbox.append((instance_id, kind, value))

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        self.launcher.emit.remote(batch)


def _describe(error: BaseException, program: Program) -> str:
    """``Type: message`` plus where in the program it was raised (the host's own frames are noise to the user)."""
    where = [
        f"{frame.filename.split('/', 1)[-1]} line {frame.lineno}, in {frame.name}"
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename.startswith(f"<{program.label}>")
    ]
    text = f"{type(error).__name__}: {error}"
    return f"{text} (at {where[-1]})" if where else text
