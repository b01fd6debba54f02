"""MCP (Model Context Protocol) for inferlets: the tools, resources and prompts of the MCP servers declared in the
cluster's config.toml (``[mcp.<name>]``: a stdio ``command`` or a streamable-HTTP ``url``).

    mcp.available_servers() -> list[str]
    mcp.connect(name) -> McpSession                   with mcp.connect("search") as s: ...
        s.list_tools()            s.call_tool(name, args)         -> str: the raw JSON result
        s.list_resources()        s.read_resource(uri)
        s.list_prompts()          s.get_prompt(name, args)
    await mcp.connect_async(name); await s.call_tool_async(name, args); ...   the same without blocking the loop

Sync and async. The SDK references (Python, Rust, JS) make every MCP call synchronous: in Pie each inferlet is its
own WASM instance, so a blocking call stalls only that inferlet. Here many inferlets share one process and one event
loop, so a blocking call stalls all of them until the server answers. We keep the reference's sync methods, so code
written against the reference runs unchanged, and give each one an ``_async`` twin (the Rust SDK's name for async
variants) that waits without blocking: use the twins for slow tools and wherever inferlets share a process.

Where sessions run. The MCP clients of every session in a process live on one background thread with its own event
loop: the sync methods block on it (a call on the inferlet's own loop could never complete while that loop is
blocked) and the twins await it. A stdio server is a child process of the inferlet's process, on whichever node the
inferlet runs, so its command must exist there (use absolute paths); it inherits only a minimal environment (HOME,
PATH, ...) plus the declared ``env``.

Results and errors, as Pie's MCP bridge has them. A result is the server's result object as JSON (MCP's wire names:
``inputSchema``, ``isError``, ``nextCursor``, ...); a list is its first page. A tool that fails returns normally
with ``"isError": true``: the failure is the model's to read. A JSON-RPC error response (unknown resource, invalid
params, a request that timed out) raises ``McpError`` carrying the error object. A server that cannot be started or
reached raises ``ConnectionError``; a name that is not declared raises ``ValueError``.

Lifetime. A session ends on ``close()``, at the end of its ``with`` block, or when the inferlet ends (the host's
``Runtime.close`` calls ``close_sessions``); ending a stdio session ends its server (stdin closed; terminated, then
killed, if it lingers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import shlex
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inferlet import runtime

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 120.0  # how long any request (the handshake included) waits for the server's answer
CLOSE_TIMEOUT_S = 5.0  # how long closing waits for sessions to end (stdio: 0.5 s flush + 2 s grace, then a kill)


@dataclass(frozen=True)
class ServerSpec:
    """How to reach one declared MCP server (what ``Runtime.mcp_servers`` maps each name to)."""

    command: tuple[str, ...] | None = None  # argv of a stdio server, started for each session
    url: str | None = None  # a streamable-HTTP endpoint, e.g. http://host:8000/mcp
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for a stdio server


class McpError(RuntimeError):
    """The server answered with a JSON-RPC error; ``str()`` is the error object as JSON."""

    def __init__(self, code: int, message: str, data: Any = None):
        self.code, self.message, self.data = code, message, data
        error = {"code": code, "message": message} | ({} if data is None else {"data": data})
        super().__init__(json.dumps(error))


def available_servers() -> list[str]:
    """Names of the MCP servers this inferlet can connect to."""
    return sorted(runtime.current().mcp_servers)


def connect(name: str) -> McpSession:
    """Open a session with server ``name``; blocks this process' event loop until the server has answered."""
    session = _start(name)
    try:
        session._ready.result()
    except BaseException:
        session._request_close()
        raise
    return session


async def connect_async(name: str) -> McpSession:
    """Open a session with server ``name`` without blocking the event loop."""
    session = _start(name)
    try:
        await asyncio.wrap_future(session._ready)
    except BaseException:  # failed, or cancelled while connecting: the session must not outlive this call
        session._request_close()
        raise
    return session


def close_sessions(owner: runtime.Runtime) -> None:
    """End every session an inferlet left open; ``Runtime.close`` calls this when it ends (registered with the
    inferlet's first session)."""
    sessions = list(_live_sessions.pop(owner.instance_id, ()))  # a copy: sessions that end leave the set meanwhile
    for session in sessions:
        session._request_close()
    concurrent.futures.wait([session._finished for session in sessions], timeout=CLOSE_TIMEOUT_S)


class McpSession:
    """A connection to one MCP server; every method returns the raw JSON result of one MCP request."""

    def __init__(self, name: str, spec: ServerSpec):
        self.name = name
        self._loop = _background_loop()
        self._client: Any = None  # the mcp package's Client, set while connected
        self._closed = False
        self._closing = asyncio.Event()  # set on the background loop to end the session
        self._abandon: Any = None  # an anyio CancelScope around the connection, cancelled to stop connecting
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ready.set_running_or_notify_cancel()  # a caller that stops waiting must not cancel it under _serve
        self._finished = asyncio.run_coroutine_threadsafe(self._serve(spec), self._loop)

    def list_tools(self) -> str:
        """Raw ``tools/list`` result: ``{"tools": [...]}``."""
        return self._call(lambda client: client.list_tools())

    def call_tool(self, name: str, args: Mapping[str, Any] | str | None = None) -> str:
        """Raw ``tools/call`` result; ``args`` is a dict or its JSON text."""
        arguments = _arguments(args)
        return self._call(lambda client: client.call_tool(name, arguments))

    def list_resources(self) -> str:
        """Raw ``resources/list`` result: ``{"resources": [...]}``."""
        return self._call(lambda client: client.list_resources())

    def read_resource(self, uri: str) -> str:
        """Raw ``resources/read`` result: ``{"contents": [...]}``."""
        return self._call(lambda client: client.read_resource(uri))

    def list_prompts(self) -> str:
        """Raw ``prompts/list`` result: ``{"prompts": [...]}``."""
        return self._call(lambda client: client.list_prompts())

    def get_prompt(self, name: str, args: Mapping[str, str] | str | None = None) -> str:
        """Raw ``prompts/get`` result; ``args`` is a dict of strings or its JSON text."""
        arguments = _arguments(args)
        return self._call(lambda client: client.get_prompt(name, arguments))

    # The same requests, awaited without blocking the event loop.

    async def list_tools_async(self) -> str:
        return await self._call_async(lambda client: client.list_tools())

    async def call_tool_async(self, name: str, args: Mapping[str, Any] | str | None = None) -> str:
        arguments = _arguments(args)
        return await self._call_async(lambda client: client.call_tool(name, arguments))

    async def list_resources_async(self) -> str:
        return await self._call_async(lambda client: client.list_resources())

    async def read_resource_async(self, uri: str) -> str:
        return await self._call_async(lambda client: client.read_resource(uri))

    async def list_prompts_async(self) -> str:
        return await self._call_async(lambda client: client.list_prompts())

    async def get_prompt_async(self, name: str, args: Mapping[str, str] | str | None = None) -> str:
        arguments = _arguments(args)
        return await self._call_async(lambda client: client.get_prompt(name, arguments))

    def close(self) -> None:
        """End the session (a stdio server exits); blocks the event loop until it has, at most ``CLOSE_TIMEOUT_S``."""
        self._request_close()
        concurrent.futures.wait([self._finished], timeout=CLOSE_TIMEOUT_S)

    async def close_async(self) -> None:
        """End the session without blocking the event loop."""
        self._request_close()
        await asyncio.wait([asyncio.wrap_future(self._finished)], timeout=CLOSE_TIMEOUT_S)

    def __enter__(self) -> McpSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> McpSession:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close_async()

    def _call(self, request: Callable[[Any], Awaitable[Any]]) -> str:
        return self._submit(request).result()

    async def _call_async(self, request: Callable[[Any], Awaitable[Any]]) -> str:
        return await asyncio.wrap_future(self._submit(request))

    def _submit(self, request: Callable[[Any], Awaitable[Any]]) -> concurrent.futures.Future[str]:
        if self._closed:
            raise RuntimeError(f"the session with MCP server {self.name!r} is closed")
        return asyncio.run_coroutine_threadsafe(self._request(request), self._loop)

    async def _request(self, request: Callable[[Any], Awaitable[Any]]) -> str:
        """On the background loop: one request, its result as the JSON the server sent."""
        from mcp import MCPError

        if self._client is None:
            raise RuntimeError(f"the session with MCP server {self.name!r} is closed")
        try:
            result = await request(self._client)
        except MCPError as error:
            raise McpError(error.code, error.message, error.data) from None
        return result.model_dump_json(by_alias=True, exclude_unset=True)

    async def _serve(self, spec: ServerSpec) -> None:
        """On the background loop, for the session's whole life: the mcp client must be entered and exited by one
        task, so this one connects, waits to be asked to close, and disconnects."""
        import anyio

        where = shlex.join(spec.command) if spec.command else spec.url
        try:
            with anyio.CancelScope() as self._abandon:
                if self._closing.is_set():
                    return
                async with _client(spec) as client:
                    self._client = client
                    self._ready.set_result(None)
                    await self._closing.wait()
        except Exception as error:
            if self._ready.done():
                log.warning("MCP server %r: closing the session failed: %s", self.name, _describe(error))
            else:
                self._ready.set_exception(ConnectionError(f"MCP server {self.name!r} ({where}): {_describe(error)}"))
        finally:
            self._client = None
            if not self._ready.done():
                self._ready.set_exception(ConnectionError(f"MCP server {self.name!r}: closed while connecting"))

    def _request_close(self) -> None:
        """Ask the session to end, once; returns at once."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        """On the background loop: end the session, or abandon it if it is still connecting (the stdio transport
        stops its server even then)."""
        self._closing.set()
        if self._abandon is not None and not self._ready.done():
            self._abandon.cancel()


_live_sessions: dict[str, set[McpSession]] = {}  # instance id -> its inferlet's sessions that have not ended yet
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _start(name: str) -> McpSession:
    current = runtime.current()
    spec = current.mcp_servers.get(name)
    if spec is None:
        declared = ", ".join(sorted(current.mcp_servers)) or "none (declare [mcp.<name>] tables in config.toml)"
        raise ValueError(f"no MCP server named {name!r}; available: {declared}")
    session = McpSession(name, spec)
    if current.instance_id not in _live_sessions:  # its stdio servers are child processes: end them with it
        current.on_close(functools.partial(close_sessions, current))
    live = _live_sessions.setdefault(current.instance_id, set())
    live.add(session)
    session._finished.add_done_callback(lambda _: live.discard(session))
    return session


def _background_loop() -> asyncio.AbstractEventLoop:
    """The process' MCP event loop, started on first use on a daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="inferlet-mcp", daemon=True).start()
            _loop = loop
        return _loop


def _client(spec: ServerSpec):
    """The mcp package's client for one server, imported here so that ``import inferlet`` stays light."""
    from mcp import Client, StdioServerParameters
    from mcp.types import Implementation

    if spec.command:
        server = StdioServerParameters(command=spec.command[0], args=list(spec.command[1:]), env=dict(spec.env))
    else:
        server = spec.url
    info = Implementation(name="pie-inferlet", version=runtime.VERSION)
    # cache=None: every call reaches the server, as a raw request does.
    return Client(server, read_timeout_seconds=REQUEST_TIMEOUT_S, client_info=info, cache=None)


def _arguments(args: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Tool or prompt arguments given as a dict or as JSON text (the Rust SDK's form)."""
    if args is None:
        return {}
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, Mapping):
        raise ValueError(f"MCP arguments must be a JSON object, not {type(args).__name__}")
    return dict(args)


def _describe(error: BaseException) -> str:
    """What went wrong, with the task groups of the mcp package unwrapped to their causes."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in error.exceptions)
    return f"{type(error).__name__}: {error}"
