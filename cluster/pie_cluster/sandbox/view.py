"""What a worker reaches, translated into its sandbox: sockets bound in, other nodes through relays.

A worker has no network of its own, so every address it is given must be a Unix socket the host binds into it.
Replicas and bus shards on this node already listen on one; those on other nodes are reached through a relay: a
Unix socket the host listens on and pipes, byte for byte, to the TCP address (the replica channel and ZeroMQ speak
the same protocol over either, so nothing above the socket notices). Each model's tokenizer and template files are
bound in from a copy that holds no weights.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from inferlet.runtime import ModelEndpoint

from pie_cluster.model_files import write_files
from pie_cluster.replica_relay import splice
from pie_cluster.sandbox.bwrap import MODELS, SOCKETS

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx")


@dataclass
class SandboxView:
    """One set of services as a worker sees them, with the mounts that make it so."""

    endpoints: dict[str, ModelEndpoint]
    bus: tuple[str, ...]
    sockets: dict[str, str] = field(default_factory=dict)  # host path (a socket, or a bus shard's directory) -> inside
    models: dict[str, str] = field(default_factory=dict)  # host directory -> inside


class Relays:
    """The host's relays to TCP addresses, one Unix socket each, made on first use and kept while the host runs."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._servers: dict[str, tuple[str, asyncio.AbstractServer]] = {}

    async def path_for(self, address: str) -> str:
        """The Unix socket that reaches ``tcp://host:port``."""
        if address not in self._servers:
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            path = str(self._directory / f"relay-{hashlib.sha256(address.encode()).hexdigest()[:16]}.sock")
            server = await asyncio.start_unix_server(lambda r, w: _pipe(r, w, host, int(port)), path=path)
            Path(path).chmod(0o666)  # the worker's uid connects; what it may do there its capability decides
            self._servers[address] = (path, server)
        return self._servers[address][0]

    def close(self) -> None:
        for _, server in self._servers.values():
            server.close()
        self._servers.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int) -> None:
    try:
        upstream = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
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
    view.bus = tuple([await _bus_inside(address, view, relays) for address in bus])
    return view


async def _bus_inside(address: str, view: SandboxView, relays: Relays) -> str:
    """A shard on this node is bound in by its directory, so that the socket its restart makes there is seen."""
    if not address.startswith("ipc://"):
        return await _socket_inside(address, view, relays)
    socket = Path(address.removeprefix("ipc://"))
    inside = f"{SOCKETS}/bus-{len(view.sockets)}"
    view.sockets[str(socket.parent)] = inside
    return f"ipc://{inside}/{socket.name}"


async def _socket_inside(address: str, view: SandboxView, relays: Relays) -> str:
    kind, _, where = address.partition("://")
    host_path = where if kind == "ipc" else await relays.path_for(address)
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
