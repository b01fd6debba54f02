"""``config.toml``: what a Pie cluster serves and how (models and replicas, HTTP, auth, launcher, bus, MCP).

Shaped like Pie's own config (``[[model]]`` entries with a ``name``; the first is the default), with Ray-specific
keys for placement. Everything has a default, so an empty file serves the embedded tiny model; auth is on unless
the file (or ``pie start --no-auth``) turns it off explicitly::

    [server]
    host = "0.0.0.0"
    port = 8080
    ingress_replicas = 2              # or [server.autoscaling] min_replicas / max_replicas / target_ongoing_requests

    [auth]
    tokens = { "s3cret-alice" = "alice", "s3cret-bob" = "bob" }   # bearer token -> user

    [[model]]
    name = "default"
    path = "/models/Qwen3-0.6B"       # a Hugging Face directory; omit for the embedded tiny model
    tensor_parallel = 2
    replicas = 2                      # data-parallel copies, each TP group on one node
    placement = "spread"              # replicas on different nodes where they fit ("strict_spread": always)
    pages = 8192
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from inferlet.mcp import ServerSpec
from pie_workers.backends import check_backend
from pie_workers.engine.tenancy import TenantLimits
from pie_workers.wire.admission import ConnectionLimits
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pie_cluster.limits import AdmissionLimits, BusLimits, ChannelLimits
from pie_cluster.mcp_servers import parse_mcp_servers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class IngressAutoscaling(_Strict):
    """Ray Serve's autoscaling of the HTTP ingress (``[server.autoscaling]``), instead of a fixed replica count."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(256, gt=0)  # per replica: event streams are long-lived requests

    @model_validator(mode="after")
    def _ordered(self) -> IngressAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("[server.autoscaling] max_replicas must be at least min_replicas")
        return self


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    max_ongoing_requests: int = Field(1024, ge=1)  # Serve's default of 5 collapses under concurrent event streams
    ingress_replicas: int = Field(1, ge=1)  # HTTP ingress replicas (each a light actor: the launcher does the work)
    autoscaling: IngressAutoscaling | None = None  # scale the ingress with load instead (overrides ingress_replicas)
    # how the ingress spreads OpenAI requests over a model's replicas: by shared prompt prefix (cache hits) with a
    # load cap, or by requests in flight alone (see ingress/routing.py)
    routing: Literal["prefix", "least_loaded"] = "prefix"

    def deployment_options(self) -> dict:
        """Ray Serve options of the ingress deployment."""
        options: dict = {"max_ongoing_requests": self.max_ongoing_requests}
        if self.autoscaling is None:
            options["num_replicas"] = self.ingress_replicas
        else:
            options["autoscaling_config"] = self.autoscaling.model_dump()
        return options


class AuthConfig(_Strict):
    enabled: bool = True
    tokens: dict[str, str] = Field(default_factory=dict)  # bearer token -> username


class ModelConfigEntry(_Strict):
    name: str = "default"
    path: str | None = None  # HF model directory; None: the embedded tiny model
    arch: Literal["llama", "qwen3"] = "llama"  # which embedded model, when path is None
    tensor_parallel: int = Field(1, ge=1)
    replicas: int = Field(1, ge=1)  # the count, fixed; with min/max_replicas, the count it starts with
    min_replicas: int | None = Field(None, ge=1)  # the autoscaler's bounds (None: replicas); control/autoscaler.py
    max_replicas: int | None = Field(None, ge=1)
    target_load: float = Field(32.0, gt=0)  # live contexts per replica the autoscaler aims at
    upscale_delay_s: float = Field(10.0, ge=0)  # how long more replicas must be wanted before one is added
    downscale_delay_s: float = Field(60.0, ge=0)  # ... fewer, before one is removed
    load_window_s: float = Field(10.0, ge=0)  # the load is the mean over this long (0: each reading alone)
    placement: Literal["spread", "strict_spread", "pack"] = "spread"  # how replicas share nodes (Ray's strategies)
    pages: int = Field(4096, ge=1)
    page_size: int = Field(16, ge=1)
    cpus_per_rank: int | None = Field(None, ge=1)  # torch threads per rank; None: what the nodes spare (cpu_share)
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources each replica's bundle takes
    use_gpu: bool | None = None  # None: GPUs when the cluster has them
    max_batch_tokens: int = Field(2048, ge=1)
    max_batch_requests: int = Field(256, ge=1)
    backend: Literal["auto", "torch", "vllm"] = "auto"  # vLLM's kernels where installed on a CPU, else torch
    compile: Literal["off", "on", "auto"] = "auto"  # decode steps through graphs (RunnerSettings.compile)

    @model_validator(mode="after")
    def _backend_takes_the_page_size(self) -> ModelConfigEntry:
        check_backend(self.backend, self.page_size)  # a ValueError naming the page sizes its kernels take
        return self

    @model_validator(mode="after")
    def _replicas_within_bounds(self) -> ModelConfigEntry:
        if "replicas" not in self.model_fields_set and self.min_replicas is not None:
            self.replicas = self.min_replicas  # the count it starts with: the least it may have
        if not self.fewest <= self.replicas <= self.most:
            raise ValueError(
                f"[[model]] {self.name!r}: min_replicas ({self.fewest}) <= replicas ({self.replicas}) <= "
                f"max_replicas ({self.most}) does not hold"
            )
        return self

    @property
    def fewest(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def most(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas


EVENT_BYTES_CEILING = 16 << 20  # no event value may be larger, whatever [limits] says: the worker protocol's bound


class LauncherConfig(_Strict):
    event_buffer: int = Field(4096, ge=16)  # events kept per instance for late attach (oldest dropped)
    keep_finished: int = Field(1024, ge=0)  # finished instances still listed and attachable
    default_deadline_s: float | None = None
    program_store_mib: int = Field(1024, ge=1)  # per user: uploaded programs kept on disk; unused ones evicted past it
    program_store_dir: str | None = None  # where the launcher's private store directory is made (None: the temp dir)
    # Admission: instances running at once, and launches waiting for a slot, overall and per user; a launch past
    # the waiting limits is refused (HTTP 429 with Retry-After)
    max_running: int = Field(4096, ge=1)
    max_running_per_user: int = Field(1024, ge=1)
    max_queued: int = Field(4096, ge=0)
    max_queued_per_user: int = Field(1024, ge=0)

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_running, self.max_running_per_user, self.max_queued, self.max_queued_per_user)

    def channel_limits(self, limits: LimitsConfig | None = None) -> ChannelLimits:
        sizes = (limits or LimitsConfig()).channel_sizes()
        return ChannelLimits(self.event_buffer, self.keep_finished, **sizes)


class BusConfig(_Strict):
    shards: int = Field(2, ge=1)


class MarketConfig(_Strict):
    default_endowment: float = Field(64.0, ge=0)  # credits of an instance launched without a token budget


class ResponsesConfig(_Strict):
    """The Responses API's stored responses (``[responses]``): each keeps its conversation's KV context as a
    snapshot, and both are deleted ``ttl_s`` after the response was made. A stored turn keeps its pages resident for
    ``resident_s``; then they become prefix cache, which memory pressure evicts, and a continuation recomputes what
    is gone from the token lineage. Before the snapshot, the turn's program may park (``park_s``, ``max_parked``):
    its next turn then continues the live context in the ingress it parked in."""

    ttl_s: float = Field(86400.0, gt=0)
    resident_s: float = Field(300.0, ge=0)
    # a stored turn's program waits this long in the ingress, its context live, for the conversation's next turn
    # (0: every turn saves its snapshot and ends); at most max_parked wait per ingress replica, the oldest saved first
    park_s: float = Field(30.0, ge=0)
    max_parked: int = Field(256, ge=0)


class SupervisionConfig(_Strict):
    """How the controller watches replicas (``[supervision]``): every ``probe_every_s`` it asks every rank of every
    tensor-parallel group to answer within ``probe_deadline_s``; a rank that is dead, or that misses ``misses``
    probes in a row (hung), gets its whole group replaced. A replacement that is not placed and loaded within
    ``start_s`` is given up and tried again on the next probe."""

    probe_every_s: float = Field(2.0, gt=0)
    probe_deadline_s: float = Field(10.0, gt=0)
    misses: int = Field(2, ge=1)
    start_s: float = Field(600.0, gt=0)


class SandboxConfig(_Strict):
    """How uploaded programs are confined (``[sandbox]``): each user's inferlets run in that user's worker processes
    under bubblewrap, with these limits per worker. ``mode = "off"`` runs them inside the trusted host instead —
    only for clusters whose users are all trusted (every program can then reach Ray and every other user's work)."""

    mode: Literal["bubblewrap", "off"] = "bubblewrap"
    memory_mib: int = Field(4096, ge=64)  # address space of each worker process (RLIMIT_AS)
    cpu_seconds: int = Field(3600, ge=1)  # CPU time of one worker process before the kernel ends it (RLIMIT_CPU)
    max_processes: int = Field(64, ge=4)  # processes and threads of one worker (pids.max; else RLIMIT_NPROC + census)
    worker_memory_mib: int = Field(8192, ge=64)  # one worker's processes together (memory.max; else the census)
    worker_cpus: float = Field(4.0, gt=0)  # CPUs one worker's processes together may keep busy (cpu.max; cgroups only)
    # False: per-process limits and the host's census even where cgroups could be made (the host then writes no cgroup)
    cgroups: bool = True
    nice: int = Field(10, ge=0, le=19)  # workers' CPU priority below the trusted side's: a busy tenant never starves it
    max_workers_per_user: int = Field(4, ge=1)  # one user's workers on a node, isolated ones too; more launches wait
    max_file_mib: int = Field(256, ge=1)  # largest file a worker may write (RLIMIT_FSIZE)
    scratch_mib: int = Field(256, ge=1)  # the worker's private /tmp (a tmpfs)
    egress: bool = False  # True: workers share the node's network (MCP servers by URL, web tools); never Ray's ports
    read_only: list[str] = Field(default_factory=list)  # more host paths workers may read (a stdio MCP server's files)
    stall_s: float = Field(10.0, gt=0)  # a worker one task step of which holds its event loop this long is ended
    idle_s: float = Field(60.0, ge=0)  # an idle worker is kept this long for the user's next launch

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


class CacheConfig(_Strict):
    """Who may reuse whose KV pages (``[cache]``). ``share = "user"`` (the default): a cached prefix is found only by
    lookups of the user who wrote it, so no user can learn by a counter or by timing whether another user's prompt is
    cached. ``share = "cluster"``: every user's lookups find every page (more hits when users send the same system
    prompt; the side channel that remains is stated in the README's security model). A request may also name its own
    salt (``cache_salt`` on the OpenAI and Responses routes), which narrows reuse to requests naming the same salt."""

    share: Literal["user", "cluster"] = "user"


class LimitsConfig(_Strict):
    """Per-user bounds on what tenants share (``[limits]``), enforced on the trusted side where each thing is stored
    or executed: replicas, bus shards, the market and the inferlet hosts. Going over one fails the inferlet that
    went over with an error naming the limit; it never costs another user anything."""

    # An instance's events, enforced by the host that keeps its channel (``events.py``). Stdout and stderr together:
    # past the rate (after a burst) output is dropped with one line saying how much; past the total, the instance
    # is ended (runaway output costs its host work for every byte, dropped or not).
    stdout_bytes_per_s: int = Field(1 << 20, ge=1)  # sustained stdout+stderr bytes per second per instance
    stdout_burst_bytes: int = Field(4 << 20, ge=1)  # stdout+stderr bytes an instance may write at once
    stdout_total_bytes: int = Field(64 << 20, ge=1)  # stdout+stderr bytes written (kept or dropped) per instance
    event_bytes: int = Field(1 << 20, ge=1, le=EVENT_BYTES_CEILING)  # one message, file or error event's value
    return_bytes: int = Field(4 << 20, ge=1, le=EVENT_BYTES_CEILING)  # an instance's return value (JSON)
    event_log_bytes: int = Field(8 << 20, ge=1)  # events kept per instance (oldest dropped; its ending never)
    # What clients send instances (session messages and files) and they have not received yet, kept by the host that
    # runs them (``hosts/inbox.py``); past either bound a send is refused with 429
    inbox_bytes: int = Field(64 << 20, ge=1)  # waiting for one instance
    inbox_bytes_per_user: int = Field(256 << 20, ge=1)  # waiting for one user's instances on one host

    # What a replica holds per user (``engine/tenancy.py``): snapshots and LoRA adapters.
    snapshots_per_user: int = Field(1024, ge=1)  # snapshots one user holds on one replica (and names per model)
    # KV pages one user's snapshots hold on one replica, but for those the directory recomputes (they yield their
    # pages at no loss); None: half that replica's pool
    snapshot_pages_per_user: int | None = Field(None, ge=1)
    adapter_max_rank: int = Field(256, ge=1)  # a LoRA rank (also at most the adapted layers' smaller dimension)
    adapters_per_user: int = Field(64, ge=1)  # adapters one user holds on one replica
    adapter_bytes_per_user: int = Field(1 << 30, ge=1)  # bytes of their weights (float32) on one replica
    adapter_store_bytes_per_user: int = Field(1 << 30, ge=1)  # adapter weights and saved files kept in the GCS
    # The message bus, per shard (``bus/quotas.py``).
    bus_message_bytes: int = Field(16 << 20, ge=1)  # one pushed or broadcast message
    bus_queued_bytes_per_user: int = Field(64 << 20, ge=1)  # messages queued for one user on one shard
    bus_journal_bytes: int = Field(2 << 30, ge=1)  # a shard's journal on its node's disk (see ``bus/quotas.py``)
    # The market (``market/market.py``): credits a launch's token budget may endow it with (the rest of the budget
    # still limits its tokens); each user's credits are at most this times ``[launcher] max_running_per_user``.
    max_endowment: float = Field(65536.0, ge=0)
    # Connections to each replica's channel and each bus shard (``pie_workers/wire/admission.py``); a connection
    # proves its capability before anything else it sends is read.
    connections_per_instance: int = Field(16, ge=1)  # live verified connections carrying one instance
    # live verified connections carrying any instance of one user: on the bus one per running instance, so above
    # [launcher] max_running_per_user (1024) times the few an instance opens
    connections_per_user: int = Field(4096, ge=1)
    unverified_per_peer: int = Field(64, ge=1)  # connections of one Unix uid or IP not yet past their handshake
    handshake_s: float = Field(5.0, gt=0)  # how long a new replica connection may take to send its handshake

    def connection_limits(self) -> ConnectionLimits:
        """The part every replica and bus shard enforces on its connections."""
        return ConnectionLimits(
            self.connections_per_instance, self.connections_per_user, self.unverified_per_peer, self.handshake_s
        )

    def channel_sizes(self) -> dict[str, int]:
        """The part an instance's channel enforces (``ChannelLimits``)."""
        return self.model_dump(
            include={"stdout_bytes_per_s", "stdout_burst_bytes", "stdout_total_bytes"}
            | {"event_bytes", "return_bytes", "event_log_bytes", "inbox_bytes", "inbox_bytes_per_user"}
        )

    def tenant_limits(self, cache: CacheConfig) -> TenantLimits:
        """The part a replica enforces."""
        return TenantLimits(
            shared_prefixes=cache.share == "cluster",
            **self.model_dump(
                include={"snapshots_per_user", "snapshot_pages_per_user", "adapter_max_rank", "adapters_per_user"}
                | {"adapter_bytes_per_user"}
            ),
            connections=self.connection_limits(),
        )

    def bus_limits(self) -> BusLimits:
        """The part each bus shard enforces."""
        return BusLimits(self.bus_message_bytes, self.bus_queued_bytes_per_user, self.bus_journal_bytes)


class PieConfig(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    model: list[ModelConfigEntry] = Field(default_factory=lambda: [ModelConfigEntry()])
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    market: MarketConfig = Field(default_factory=MarketConfig)
    mcp: dict[str, dict] = Field(default_factory=dict)  # [mcp.<name>] server declarations
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    supervision: SupervisionConfig = Field(default_factory=SupervisionConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @field_validator("model")
    @classmethod
    def _unique_names(cls, models: list[ModelConfigEntry]) -> list[ModelConfigEntry]:
        if not models:
            raise ValueError("at least one [[model]] is needed")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"[[model]] names must be unique, got {names}")
        return models

    def serving(self, model_dir: Path, name: str | None = None, **keys: int | None) -> PieConfig:
        """This config serving one Hugging Face directory in place of its ``[[model]]`` entries (``pie start
        --model``, as ``vllm serve`` does): the first entry's settings, the directory as its ``path``, ``name``
        (default: the directory's name) and the other ``[[model]]`` ``keys`` given (None: the entry's)."""
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"--model {model_dir}: not a Hugging Face model directory (it has no config.json)")
        update = {"name": name or model_dir.resolve().name, "path": str(model_dir.resolve())}
        update |= {key: value for key, value in keys.items() if value is not None}
        entry = ModelConfigEntry.model_validate(self.model[0].model_dump(exclude_unset=True) | update)
        return self.model_copy(update={"model": [entry]})

    @classmethod
    def load(cls, path: str | Path | None) -> PieConfig:
        """Read a config file (None: all defaults); errors name the file and the offending key."""
        if path is None:
            return cls()
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
        try:
            return cls.model_validate(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @field_validator("mcp")
    @classmethod
    def _mcp_tables(cls, tables: dict[str, dict]) -> dict[str, dict]:
        parse_mcp_servers({"mcp": tables})  # errors name the [mcp.<name>] table
        return tables

    def mcp_specs(self) -> dict[str, ServerSpec]:
        return {name: server.spec() for name, server in parse_mcp_servers({"mcp": self.mcp}).items()}

    def check_auth(self) -> None:
        if self.auth.enabled and not self.auth.tokens:
            raise ValueError("auth is on but [auth.tokens] is empty: add tokens, or turn auth off explicitly")

    def exposed_tokens(self, path: Path) -> str | None:
        """Why the file this config was read from leaks its bearer tokens to other OS users (None: it does not).
        The sandbox hides the file from inferlets; its mode is what keeps other local accounts out."""
        mode = path.stat().st_mode & 0o777
        if not (self.auth.enabled and self.auth.tokens and mode & 0o077):
            return None
        return f"{path} holds [auth] tokens and is open to other users on this host (mode {mode:o}): chmod 600 {path}"
