"""What an inferlet knows about where it runs: its identity and the models it can reach.

``username`` and ``instance_id`` are for the inferlet's own information; replicas and bus shards believe only
``capability``, a token the trusted host minted for the instance and signed with a secret the inferlet never sees.

The host that launches an inferlet installs a ``Runtime`` for it in a context variable, so many inferlets can share
one process (each asyncio task sees its own runtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

VERSION = "0.1.0"


@dataclass(frozen=True)
class ModelEndpoint:
    """How to reach one replica of a model, and what the SDK needs to know about it."""

    name: str
    address: str  # ipc:// on the replica's node, tcp:// otherwise
    model_dir: str
    page_size: int
    vocab_size: int
    architecture: str
    # where to go if this replica dies, in order: the model's other replicas, then the host's relay to whichever
    # replica serves (its replacement); empty: nowhere, and contexts keep no lineage (``inferlet._failover``)
    failover: tuple[str, ...] = ()


class SessionIO(Protocol):
    """What the host provides for ``inferlet.session``: events to the client, messages and files from it."""

    def send(self, text: str) -> None: ...

    def send_file(self, data: bytes) -> None: ...

    async def receive(self) -> str: ...

    async def receive_file(self) -> bytes: ...


class TokenBudgetExhausted(RuntimeError):
    """The inferlet has had the model generate more tokens than its launch's ``token_budget`` (counted here as a fast
    path; the replica, which the budget reaches in the instance's capability, is what enforces it)."""


class QuotaExceeded(RuntimeError):
    """A replica or bus shard refused a request that would take the inferlet's user past one of the cluster's
    ``[limits]`` (snapshots, adapters, queued bus bytes...); the message names the limit. Nothing was changed."""


@dataclass
class Runtime:
    username: str
    instance_id: str
    endpoints: dict[str, ModelEndpoint]
    capability: str  # proves (user, instance) to replicas and bus shards; see pie_workers.wire.capability
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    models_loaded: dict[str, Any] = field(default_factory=dict)
    bus: tuple[str, ...] = ()  # one address per message-bus shard (see inferlet.messaging); empty: no messaging
    bus_client: Any = None  # opened by inferlet.messaging on first use
    mcp_servers: dict[str, Any] = field(default_factory=dict)  # name -> inferlet.mcp.ServerSpec, from config.toml
    io: SessionIO | None = None  # the launching client's side of inferlet.session; None: no client attached
    token_budget: int | None = None  # tokens the model may generate for this inferlet; None: no limit
    tokens_generated: int = 0
    first_generated_at: float | None = None  # time.perf_counter() when a pass first generated for it (first pass)
    opening_balance: float | None = None  # the credits its market wallet opened with (None: not known here)
    opened_at: float = 0.0  # time.monotonic() when that wallet opened
    _closers: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def spend_tokens(self, n: int) -> None:
        """Count ``n`` tokens the model generated for this inferlet; past its budget, the pass that went over
        raises (the inferlet ends with that error unless it catches it, and its pages are released with it)."""
        self.tokens_generated += n
        if n and self.first_generated_at is None:
            self.first_generated_at = time.perf_counter()
        if self.token_budget is not None and self.tokens_generated > self.token_budget:
            raise TokenBudgetExhausted(
                f"token budget exhausted: {self.tokens_generated} tokens generated, the budget is {self.token_budget}"
            )

    def wallet_opened(self, balance: float) -> None:
        """Its market wallet opened just now with ``balance`` credits: ``inferlet.scheduling`` bids from that until
        the replica's first reading of the wallet arrives."""
        self.opening_balance, self.opened_at = balance, time.monotonic()

    def move_bus(self, addresses: tuple[str, ...]) -> None:
        """The bus shards listen at ``addresses`` now (one whose node was lost was made again elsewhere): the bus
        client's sockets to the moved ones connect there (what they had not got confirmed goes again)."""
        self.bus = tuple(addresses)
        if self.bus_client is not None:
            self.bus_client.move(self.bus)

    def on_close(self, close: Callable[[], None]) -> None:
        """Run ``close`` when the inferlet ends (last registered, first run). Features that hold something for the
        inferlet (its bus client, its MCP sessions) register here, so the runtime need not know them."""
        self._closers.callback(close)

    def close(self) -> None:
        """Release everything this inferlet still holds on every replica (contexts, pages), then what its features
        registered (bus pulls and subscriptions, MCP sessions); snapshots and queued messages survive. One that
        fails to close (its replica died) does not keep the others from closing; its error is raised at the end."""
        for model in self.models_loaded.values():
            self._closers.callback(model.close)  # run first: callbacks run last registered, first run
        self.models_loaded.clear()
        self._closers.close()

    async def aclose(self) -> None:
        """``close`` for a host that runs many inferlets on one event loop: the replicas release this one's
        contexts concurrently while the loop serves the others, and each has answered when this returns."""
        models, self.models_loaded = list(self.models_loaded.values()), {}
        closed = await asyncio.gather(*(model.aclose() for model in models), return_exceptions=True)
        try:
            self._closers.close()
        finally:
            for outcome in closed:
                if isinstance(outcome, BaseException):
                    raise outcome


blocking_wait: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
"""Wraps a blocking SDK call's wait on the cluster (a replica's replacement, as long as a model load): a process that
ends stalled loops (the sandboxed worker's watchdog) sets this to excuse such waits."""

_current: contextvars.ContextVar[Runtime] = contextvars.ContextVar("inferlet_runtime")


def install(runtime: Runtime) -> contextvars.Token:
    return _current.set(runtime)


def uninstall(token: contextvars.Token) -> None:
    _current.reset(token)


def current() -> Runtime:
    try:
        return _current.get()
    except LookupError:
        raise RuntimeError("no inferlet runtime here: run the program with `pie run` or `pie submit`") from None


def models() -> list[str]:
    """Names of every model the inferlet can load."""
    return sorted(current().endpoints)


def version() -> str:
    return VERSION


def instance_id() -> str:
    return current().instance_id


def username() -> str:
    return current().username
