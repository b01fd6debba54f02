"""The last place an inferlet fails over to: a Unix socket per model, on each node, that reaches whichever of the
model's replicas serves now (``inferlet._failover``).

An inferlet's endpoint names the model's other replicas to move to when its own dies; when all of them are gone (a
model of one replica), only the replacement is left, and it listens on new sockets that an inferlet started before
it, in a sandbox whose sockets were bound in at its start, cannot reach. So the host listens on a socket of its own
per model and, for each connection, pipes it to the first replica of the model that accepts one, in the order of
the current services (``candidates``: the host's, updated when a replica is replaced; the ingress asks the
launcher), waiting up to ``WAIT_S`` for one to come up.

An inferlet opens more than one connection to an address (its awaited calls and its blocking ones go on sockets of
their own), and its contexts live on one replica: so every connection that opens with the same handshake (the
instance's capability) goes to the replica its first one went to while that one accepts them, even when the
services' order changed between the two (a replacement came up in between).

The relays run on an event loop of their own, in a thread: the process they serve may be the one whose inferlets
fail over (the ingress, a host with the sandbox off), and an inferlet's blocking call that moves its link would
otherwise wait on a relay its own blocked loop cannot serve.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import msgpack
from inferlet.runtime import ModelEndpoint

WAIT_S = 120.0  # how long a connection waits for a replica of its model to accept it
RETRY_S = 0.25  # between rounds of trying the model's replicas
CONNECT_S = 2.0  # one attempt to connect to one replica
HELLO_S = 10.0  # for a connection to send its handshake
HELLO_BYTES = 1 << 16  # ... of at most this many bytes (a capability is a few hundred)


def failing_over(endpoint: ModelEndpoint, replicas: Iterable[str], relay: str) -> ModelEndpoint:
    """``endpoint`` naming where its inferlets go if its replica dies: the model's other ``replicas`` (addresses),
    then ``relay``."""
    return replace(endpoint, failover=(*[a for a in replicas if a != endpoint.address], relay))


def every_replica_failing_over(
    endpoints: dict[str, ModelEndpoint], replicas: dict[str, tuple[ModelEndpoint, ...]], relays: dict[str, str]
) -> tuple[dict[str, ModelEndpoint], dict[str, dict[str, ModelEndpoint]]]:
    """The node's endpoints, and every replica's by address (with the tokenizer files of the node's copy: they are
    the model's, whichever replica), each naming the model's other replicas and the relay to fail over to."""
    addresses = {name: [e.address for e in options] for name, options in replicas.items()}
    by_address = {
        name: {
            e.address: failing_over(replace(e, model_dir=endpoints[name].model_dir), addresses[name], relay)
            for e in replicas.get(name, ())
        }
        for name, relay in relays.items()
    }
    return {name: failing_over(e, addresses.get(name, ()), relays[name]) for name, e in endpoints.items()}, by_address


class ReplicaRelays:
    """One relay socket per model, made on first use; ``candidates(model)``: the addresses to try, in order (called
    on the relays' thread, so it may block)."""

    def __init__(self, candidates: Callable[[str], list[str]]):
        self._candidates = candidates
        self._directory = Path(tempfile.mkdtemp(prefix="pie-replica-relays-"))
        atexit.register(shutil.rmtree, self._directory, True)
        self._servers: dict[str, tuple[str, asyncio.AbstractServer]] = {}
        self._pins: dict[tuple[str, str] | None, _Pin] = {}  # (model, capability): where its connections go
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="replica-relays", daemon=True).start()

    async def address_for(self, model: str) -> str:
        """``ipc://<socket>`` that reaches a replica of ``model`` serving now."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._listen(model), self._loop))

    async def _listen(self, model: str) -> str:
        if model not in self._servers:
            path = str(self._directory / f"{hashlib.sha256(model.encode()).hexdigest()[:16]}.sock")
            server = await asyncio.start_unix_server(lambda r, w: self._relay(model, r, w), path=path)
            Path(path).chmod(0o666)  # a sandboxed worker's uid connects; what it may do there its capability decides
            self._servers[model] = (path, server)
        return f"ipc://{self._servers[model][0]}"

    async def _relay(self, model: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        opening, capability = await _handshake(reader)
        key = (model, capability) if capability is not None else None
        while loop.time() < deadline:
            candidates = await loop.run_in_executor(None, self._candidates, model)
            pinned = self._pins.get(key)
            for address in dict.fromkeys(([pinned.address] if pinned is not None else []) + candidates):
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    upstream_reader, upstream_writer = await asyncio.wait_for(connect(address), CONNECT_S)
                    upstream_writer.write(opening)
                    with self._pinned(key, address):
                        await splice(reader, writer, upstream_reader, upstream_writer)
                    return
            await asyncio.sleep(RETRY_S)
        writer.close()

    @contextlib.contextmanager
    def _pinned(self, key: tuple[str, str] | None, address: str) -> Iterator[None]:
        """Connections of ``key`` go to ``address`` while one of them is open there."""
        if key is None:
            yield
            return
        pin = self._pins.get(key)
        if pin is None or pin.address != address:
            pin = self._pins[key] = _Pin(address)
        pin.connections += 1
        try:
            yield
        finally:
            pin.connections -= 1
            if pin.connections == 0 and self._pins.get(key) is pin:
                del self._pins[key]

    def close(self) -> None:
        for _, server in self._servers.values():
            self._loop.call_soon_threadsafe(server.close)
        self._servers.clear()


@dataclass
class _Pin:
    address: str
    connections: int = 0


async def _handshake(reader: asyncio.StreamReader) -> tuple[bytes, str | None]:
    """The bytes a connection opened with, up to its handshake ``["hello", capability]`` (``inferlet._channel``),
    and the capability; None for one that sent no well-formed handshake within ``HELLO_S`` and ``HELLO_BYTES`` (it
    is relayed unpinned, and the replica refuses it)."""
    opening, unpacker = b"", msgpack.Unpacker(max_buffer_size=HELLO_BYTES)
    with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError, msgpack.UnpackException):
        async with asyncio.timeout(HELLO_S):
            while len(opening) < HELLO_BYTES and (data := await reader.read(HELLO_BYTES - len(opening))):
                opening += data
                unpacker.feed(data)
                for hello in unpacker:
                    match hello:
                        case ["hello", str(capability)]:
                            return opening, capability
                    return opening, None
    return opening, None


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    kind, _, where = address.partition("://")
    if kind == "ipc":
        return await asyncio.open_unix_connection(where)
    host, _, port = where.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    upstream_reader: asyncio.StreamReader,
    upstream_writer: asyncio.StreamWriter,
) -> None:
    """Copy bytes both ways until either side closes; then close both."""

    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.close()

    await asyncio.gather(copy(reader, upstream_writer), copy(upstream_reader, writer))
