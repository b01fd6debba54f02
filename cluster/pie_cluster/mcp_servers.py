"""The MCP servers that config.toml declares for inferlets (``inferlet.mcp``), one ``[mcp.<name>]`` table each:

    [mcp.search]
    command = ["/opt/tools/bin/python", "/opt/tools/search_server.py"]   # stdio: started by each session
    env = { SEARCH_API_KEY = "..." }

    [mcp.docs]
    url = "http://docs.internal:8000/mcp"                                  # streamable HTTP

A stdio server runs where the inferlet that connects runs, on any node, so its command must exist on every node
(absolute paths: the inferlet's working directory is Ray's, not the config file's).
"""

from __future__ import annotations

from typing import Any

from inferlet.mcp import ServerSpec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class McpServer(BaseModel):
    """One ``[mcp.<name>]`` table: exactly one of ``command`` (stdio) and ``url`` (streamable HTTP)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    command: list[str] | None = Field(default=None, min_length=1)
    url: str | None = Field(default=None, pattern=r"^https?://")
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (a stdio server) and `url` (a streamable-HTTP server)")
        if self.env and self.url is not None:
            raise ValueError("`env` applies to stdio servers (`command`) only")
        return self

    def spec(self) -> ServerSpec:
        """What an inferlet's runtime carries to reach this server (``Runtime.mcp_servers[name]``)."""
        command = tuple(self.command) if self.command is not None else None
        return ServerSpec(command=command, url=self.url, env=dict(self.env))


def parse_mcp_servers(config: dict[str, Any]) -> dict[str, McpServer]:
    """The ``[mcp.<name>]`` tables of a parsed config.toml; a ValueError names the table that is wrong and why."""
    tables = config.get("mcp", {})
    if not isinstance(tables, dict):
        raise ValueError("config [mcp]: expected tables [mcp.<name>], one per MCP server")
    servers = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"config [mcp.{name}]: expected a table with `command` or `url`, got {table!r}")
        if "name" in table:
            raise ValueError(f"config [mcp.{name}]: the server's name is its table's key; drop `name`")
        try:
            servers[name] = McpServer.model_validate({**table, "name": name})
        except ValidationError as error:
            problems = "; ".join(_problem(e) for e in error.errors())
            raise ValueError(f"config [mcp.{name}]: {problems}") from None
    return servers


def _problem(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]
