"""A small, real MCP server for the MCP tests and example: tools, a resource and a prompt.

    python tests/support/mcp_echo_server.py              serve over stdio (what an ``[mcp.<name>] command`` runs)
    python tests/support/mcp_echo_server.py --http PORT  serve streamable HTTP at http://127.0.0.1:PORT/mcp

The ``pid`` tool lets a test find the server's process and check that it is gone once the inferlet has ended.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("echo", log_level="WARNING")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(reason: str) -> str:
    """Always fail: the error comes back as a tool result with isError set."""
    raise ToolError(reason)


@server.tool()
def sleep(seconds: float) -> str:
    """Answer after a while, to show who waits meanwhile."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def environment(key: str) -> str:
    """One variable of the server's environment ("" when unset), to check declared env reaches the server."""
    return os.environ.get(key, "")


@server.resource("echo://greeting", mime_type="text/plain")
def greeting() -> str:
    return "hello from the echo server"


@server.prompt()
def greet(name: str) -> str:
    """Ask for a greeting."""
    return f"Please greet {name}."


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
