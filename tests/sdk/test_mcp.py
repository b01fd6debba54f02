"""MCP for inferlets: servers declared in config, sessions against a real MCP server
(tests/support/mcp_echo_server.py) over stdio and streamable HTTP, raw JSON results, errors, and sessions ended
with their inferlet."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inferlet import mcp
from inferlet.mcp import McpError, ServerSpec
from inferlet.runtime import Runtime, install, uninstall
from pie_cluster.hosts.run import load_program
from pie_cluster.mcp_servers import McpServer, parse_mcp_servers
from support.paths import EXAMPLES, SUPPORT
from support.sdk_host import TRUST

ECHO_SERVER = SUPPORT / "mcp_echo_server.py"
ECHO = ServerSpec(command=(sys.executable, str(ECHO_SERVER)), env={"ECHO_MARK": "declared"})
SERVERS = {"echo": ECHO, "docs": ServerSpec(url="http://127.0.0.1:9/mcp")}


def run(main, input: dict | None = None, servers: dict[str, ServerSpec] = SERVERS):
    """Run an inferlet as ``pie_cluster.hosts.run.run_inferlet`` does, its runtime carrying the declared MCP servers."""

    async def inferlet():
        identity = TRUST.instance("alice")
        runtime = Runtime(
            username="alice",
            instance_id=identity["instance_id"],
            endpoints={},
            capability=identity["capability"],
            mcp_servers=servers,
        )
        token = install(runtime)
        try:
            return await main(input or {})
        finally:
            runtime.close()
            uninstall(token)

    return asyncio.run(inferlet())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def echo_servers() -> list[int]:
    """Pids of the echo servers this test process has started that still exist, zombies included (reads /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
            command = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
        if parent == os.getpid() and str(ECHO_SERVER).encode() in command:
            pids.append(int(proc.name))
    return pids


def text_of(result: str) -> str:
    return "".join(block["text"] for block in json.loads(result)["content"])


def test_config_declares_stdio_and_url_servers():
    config = {
        "mcp": {
            "echo": {"command": ["python", "/srv/echo.py"], "env": {"MARK": "1"}},
            "docs": {"url": "http://docs:8000/mcp"},
        }
    }
    servers = parse_mcp_servers(config)
    assert servers == {
        "echo": McpServer(name="echo", command=["python", "/srv/echo.py"], env={"MARK": "1"}),
        "docs": McpServer(name="docs", url="http://docs:8000/mcp"),
    }
    assert servers["echo"].spec() == ServerSpec(command=("python", "/srv/echo.py"), env={"MARK": "1"})
    assert servers["docs"].spec() == ServerSpec(url="http://docs:8000/mcp")
    assert parse_mcp_servers({}) == {}


@pytest.mark.parametrize(
    "table, complaint",
    [
        ({}, "exactly one of `command`"),
        ({"command": ["x"], "url": "http://h/mcp"}, "exactly one of `command`"),
        ({"command": []}, "command"),
        ({"url": "docs:8000"}, "url"),
        ({"url": "http://h/mcp", "env": {"A": "1"}}, "stdio servers"),
        ({"command": ["x"], "cwd": "/tmp"}, "cwd"),
        ({"command": ["x"], "name": "other"}, "table's key"),
        ("python server.py", "expected a table"),
    ],
)
def test_config_errors_name_the_table_and_the_problem(table, complaint):
    with pytest.raises(ValueError, match=r"config \[mcp\.bad\]") as error:
        parse_mcp_servers({"mcp": {"bad": table}})
    assert complaint in str(error.value)


def test_available_servers_are_the_declared_names():
    async def main(input):
        return mcp.available_servers()

    assert run(main) == ["docs", "echo"]
    assert run(main, servers={}) == []


def test_an_unknown_server_raises_naming_the_available_ones():
    async def main(input):
        mcp.connect("nope")

    with pytest.raises(ValueError, match=r"no MCP server named 'nope'; available: docs, echo"):
        run(main)
    with pytest.raises(ValueError, match=r"available: none \(declare \[mcp.<name>\]"):
        run(main, servers={})


def test_a_server_that_cannot_start_raises_connection_error():
    async def main(input):
        mcp.connect("broken")

    with pytest.raises(ConnectionError, match=r"MCP server 'broken' \(/nonexistent/server\): FileNotFoundError"):
        run(main, servers={"broken": ServerSpec(command=("/nonexistent/server",))})


def test_stdio_session_returns_raw_json_results_and_errors():
    async def main(input):
        with mcp.connect("echo") as session:
            out = {
                "tools": json.loads(session.list_tools()),
                "add": json.loads(session.call_tool("add", {"a": 2, "b": 3})),
                "echo_json_args": text_of(session.call_tool("echo", '{"text": "hi"}')),
                "fail": json.loads(session.call_tool("fail", {"reason": "no luck"})),
                "env": text_of(session.call_tool("environment", {"key": "ECHO_MARK"})),
                "resources": json.loads(session.list_resources()),
                "read": json.loads(session.read_resource("echo://greeting")),
                "prompts": json.loads(session.list_prompts()),
                "prompt": json.loads(session.get_prompt("greet", {"name": "Bob"})),
                "pid": int(text_of(session.call_tool("pid"))),
            }
            with pytest.raises(McpError) as error:
                session.read_resource("echo://missing")
            out["error"] = json.loads(str(error.value))
        with pytest.raises(RuntimeError, match="is closed"):
            session.list_tools()
        out["alive_after_with"] = alive(out["pid"])
        return out

    out = run(main)
    tools = {tool["name"]: tool for tool in out["tools"]["tools"]}
    assert {"echo", "add", "fail", "pid"} <= set(tools)
    assert tools["add"]["inputSchema"]["required"] == ["a", "b"]
    assert out["add"]["isError"] is False
    assert out["add"]["content"] == [{"type": "text", "text": "5"}]
    assert out["add"]["structuredContent"] == {"result": 5}
    assert out["echo_json_args"] == "hi"
    assert out["fail"]["isError"] is True and out["fail"]["content"][0]["text"].endswith("no luck")
    assert out["env"] == "declared"
    assert out["resources"]["resources"][0]["uri"] == "echo://greeting"
    assert out["read"]["contents"] == [
        {"uri": "echo://greeting", "mimeType": "text/plain", "text": "hello from the echo server"}
    ]
    assert out["prompts"]["prompts"][0]["name"] == "greet"
    assert out["prompt"]["messages"] == [{"role": "user", "content": {"type": "text", "text": "Please greet Bob."}}]
    assert out["error"]["code"] == -32602 and "echo://missing" in out["error"]["message"]
    assert out["alive_after_with"] is False


def test_a_session_left_open_ends_with_its_inferlet():
    async def forgets(input):
        session = await mcp.connect_async("echo")
        return int(text_of(await session.call_tool_async("pid")))

    async def raises(input):
        session = mcp.connect("echo")
        raise RuntimeError(f"pid {text_of(session.call_tool('pid'))}")

    pid = run(forgets)
    assert not alive(pid)
    with pytest.raises(RuntimeError, match=r"pid (\d+)") as error:
        run(raises)
    assert not alive(int(str(error.value).split()[1]))


def test_a_connection_abandoned_midway_stops_its_server():
    async def main(input):
        connecting = asyncio.create_task(mcp.connect_async("echo"))
        while not echo_servers():  # the server has started and is still starting up (importing mcp takes a while)
            await asyncio.sleep(0.01)
        connecting.cancel()
        await connecting

    with pytest.raises(asyncio.CancelledError):
        run(main)
    assert echo_servers() == []


def test_async_calls_leave_the_event_loop_free_and_sync_calls_hold_it():
    """The documented trade-off: while a sync call waits, no other task of the process runs."""

    async def main(input):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async with await mcp.connect_async("echo") as session:
            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            start = ticks
            await session.call_tool_async("sleep", {"seconds": 0.3})
            during_async = ticks - start
            start = ticks
            session.call_tool("sleep", {"seconds": 0.3})
            during_sync = ticks - start
            task.cancel()
        return during_async, during_sync

    during_async, during_sync = run(main)
    assert during_async > 0
    assert during_sync == 0


def test_the_example_lists_and_calls_tools():
    main = load_program(EXAMPLES / "mcp_tools.py")
    got = run(main, {"server": "echo", "tool": "echo", "args": '{"text": "hello"}'})
    assert got == {
        "server": "echo",
        "tools": ["add", "echo", "environment", "fail", "pid", "sleep"],
        "text": "hello",
        "error": False,
    }


@pytest.fixture
def http_echo_server():
    """The echo server on streamable HTTP at a free local port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(ECHO_SERVER), "--http", str(port)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("the streamable-HTTP echo server did not start") from None
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    server.terminate()
    server.wait(timeout=10)


def test_url_servers_speak_streamable_http(http_echo_server):
    async def main(input):
        with mcp.connect("remote") as session:
            return text_of(session.call_tool("echo", {"text": "over http"}))

    assert run(main, servers={"remote": ServerSpec(url=http_echo_server)}) == "over http"


def test_import_inferlet_does_not_import_the_mcp_package():
    probe = "import sys, inferlet; assert 'mcp' not in sys.modules; inferlet.mcp.available_servers"
    subprocess.run([sys.executable, "-c", probe], check=True)
