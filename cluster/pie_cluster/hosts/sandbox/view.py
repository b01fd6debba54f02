"""What a worker reaches, translated into its sandbox: sockets bound in, other nodes through relays.

A worker has no network of its own, so every address it is given must be a Unix socket the host binds into it.
Replicas and bus shards on this node already listen on one; those on other nodes are reached through a relay: a
Unix socket the host listens on and pipes, byte for byte, to the TCP address (the replica channel and ZeroMQ speak
the same protocol over either, so nothing above the socket notices). A bus shard's relay pipes each connection to
wherever the shard listens at that moment, so it follows a shard restarted on another node. Each model's tokenizer
and template files are bound in from a copy that holds no weights.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from inferlet.runtime import ModelEndpoint

from pie_cluster.hosts.model_files import write_files
from pie_cluster.hosts.replica_relay import CONNECT_S, connect, splice
from pie_cluster.hosts.sandbox.bwrap import MODELS, SOCKETS

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx")


@dataclass
class SandboxView:
    """One set of services as a worker sees them, with the mounts that make it so."""

    endpoints: dict[str, ModelEndpoint]
    bus: tuple[str, ...]
    sockets: dict[str, str] = field(default_factory=dict)  # host path (a socket, or a bus shard's directory) -> inside
    models: dict[str, str] = field(default_factory=dict)  # host directory -> inside


class Relays:
    """The host's relays, one Unix socket each, made on first use and kept while the host runs: one per TCP address
    (a replica on another node), and one per bus shard on another node, which pipes each connection to wherever the
    shard listens at that moment (``point_bus``): a shard whose node was lost is restarted on another, and the
    sockets of the running workers reconnect through the same relay to it."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._servers: dict[str, tuple[str, asyncio.AbstractServer]] = {}
        self._shards: list[str] = []  # where each bus shard listens now, as this node reaches it

    async def path_for(self, address: str) -> str:
        """The Unix socket that reaches ``tcp://host:port``."""
        return await self._serve(address, lambda: address)

    async def bus_path(self, index: int, address: str) -> str:
        """The Unix socket that reaches bus shard ``index`` (now at ``address``), wherever it moves."""
        self.point_bus_shard(index, address)
        return await self._serve(f"bus shard {index}", lambda: self._shards[index])

    def point_bus(self, addresses: tuple[str, ...]) -> None:
        """Where the bus shards listen now: connections from then on go there."""
        for index, address in enumerate(addresses):
            self.point_bus_shard(index, address)

    def point_bus_shard(self, index: int, address: str) -> None:
        self._shards.extend([""] * (index + 1 - len(self._shards)))
        self._shards[index] = address

    async def _serve(self, name: str, target) -> str:
        if name not in self._servers:
            path = str(self._directory / f"relay-{hashlib.sha256(name.encode()).hexdigest()[:16]}.sock")
            server = await asyncio.start_unix_server(lambda r, w: _pipe(r, w, target()), path=path)
            Path(path).chmod(0o666)  # the worker's uid connects; what it may do there its capability decides
            self._servers[name] = (path, server)
        return self._servers[name][0]

    def close(self) -> None:
        for _, server in self._servers.values():
            server.close()
        self._servers.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
    try:
        upstream = await asyncio.wait_for(connect(address), CONNECT_S)
    except (OSError, TimeoutError):
        writer.close()  # the client connects again, and finds the address of that moment
        return
    await splice(reader, writer, *upstream)


async def build_view(endpoints: dict[str, ModelEndpoint], bus: tuple[str, ...], relays: Relays) -> SandboxView:
    """``endpoints`` (model_dir already on this node) and ``bus`` as a worker must be given them."""
    view = SandboxView(endpoints={}, bus=())
    for name, endpoint in sorted(endpoints.items()):
        copy = await asyncio.to_thread(_tokenizer_copy, endpoint.model_dir)
        inside = view.models.setdefault(copy, f"{MODELS}/{len(view.models)}")  # models with the same files share it
        address = await _socket_inside(endpoint.address, view, relays)
        failover = tuple([await _socket_inside(a, view, relays) for a in endpoint.failover])
        view.endpoints[name] = replace(endpoint, address=address, model_dir=inside, failover=failover)
    view.bus = tuple([await _bus_inside(index, address, view, relays) for index, address in enumerate(bus)])
    return view


async def _bus_inside(index: int, address: str, view: SandboxView, relays: Relays) -> str:
    """A shard on this node is bound in by its directory, so that the socket its restart makes there is seen; one on
    another node is reached through its relay, which follows it if it moves."""
    if not address.startswith("ipc://"):
        return await _ipc_inside(await relays.bus_path(index, address), view)
    socket = Path(address.removeprefix("ipc://"))
    inside = f"{SOCKETS}/bus-{len(view.sockets)}"
    view.sockets[str(socket.parent)] = inside
    return f"ipc://{inside}/{socket.name}"


async def _socket_inside(address: str, view: SandboxView, relays: Relays) -> str:
    kind, _, where = address.partition("://")
    return await _ipc_inside(where if kind == "ipc" else await relays.path_for(address), view)


async def _ipc_inside(host_path: str, view: SandboxView) -> str:
    inside = f"{SOCKETS}/{len(view.sockets)}.sock"
    view.sockets[host_path] = inside
    return f"ipc://{inside}"


def _tokenizer_copy(model_dir: str) -> str:
    """A directory with the model's small files (config, tokenizer, chat template) and none of its weights."""
    files = {
        p.name: p.read_bytes()
        for p in Path(model_dir).iterdir()
        if p.is_file() and not p.name.endswith(_WEIGHTS) and p.stat().st_size < 64 << 20
    }
    return str(write_files(files))
