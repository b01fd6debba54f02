"""MCP tools: list the tools of an MCP server declared in config.toml and call one (Pie's mcp-example).

pie submit examples/mcp_tools.py -- --server echo --tool echo --args '{"text": "hello"}'

(against a cluster whose config.toml declares the server, e.g. ``[mcp.echo]``; `pie run` has no MCP servers)

It uses the ``_async`` forms, which wait without blocking the other inferlets that share this process.
"""

import json

from inferlet import mcp


async def main(input: dict) -> dict:
    server = input.get("server") or mcp.available_servers()[0]
    async with await mcp.connect_async(server) as session:
        tools = json.loads(await session.list_tools_async())["tools"]
        result = json.loads(await session.call_tool_async(input.get("tool", "echo"), input.get("args", {})))
    text = "".join(block["text"] for block in result["content"] if block["type"] == "text")
    return {
        "server": server,
        "tools": sorted(tool["name"] for tool in tools),
        "text": text,
        "error": result.get("isError", False),
    }
