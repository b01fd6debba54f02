"""The replica's LoRA adapters by name: each user's namespace, the runner's adapter slots, and PEFT files.

An adapter belongs to the user who created it (not to one inferlet run), under a name unique in that user's
namespace; operations name it by the id ``adapter_create``/``adapter_open`` returned. Its weights live in the model
runner, under that id. KV written under an adapter is hashed with the adapter's salt, renewed whenever its weights
change, so only passes under the same weights share it through the prefix trie. Saving and loading read and write
PEFT's layout in the user's directory under the adapter root.

With the cluster's directory (``directory_link``), names are the user's across every replica of the model: a name
made elsewhere is copied here when opened, new weights loaded anywhere reach every copy, a destroy drops them all,
and a path saved on one node loads on any other.

Each user's adapters here are bounded (``TenantLimits``): their rank (by ``adapter_max_rank`` and by the model's
dimensions), their count and the bytes of their weights, checked before anything is made, so a refused request
(``QuotaExceeded``) costs nothing and no other user's adapters are touched.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pie_workers.adapters import (
    DEFAULT_SIGMA,
    DEFAULT_TARGETS,
    LoraAdapter,
    LoraConfig,
    adapter_bytes,
    check_rank,
    weights_bytes,
)
from pie_workers.engine.directory_link import DirectoryLink
from pie_workers.engine.record import Session
from pie_workers.engine.tenancy import QuotaExceeded, TenantLimits
from pie_workers.peft_format import default_root, read_adapter, user_path, write_adapter
from pie_workers.runner import ModelRunner
from pie_workers.wire.messages import AdapterReply, encode


@dataclass
class NamedAdapter:
    owner: str
    name: str
    salt: bytes  # KV written under these weights hashes with it; renewed whenever the weights change
    size: int  # bytes of its weights, counted against its owner's ``adapter_bytes_per_user``


class AdapterRegistry:
    def __init__(self, runner: ModelRunner, directory: DirectoryLink | None = None, limits=TenantLimits()):
        self.runner = runner
        self.directory = directory
        self.limits = limits
        self._root = Path(runner.settings.adapter_dir) if runner.settings.adapter_dir else default_root()
        self._adapters: dict[int, NamedAdapter] = {}
        self._ids: dict[tuple[str, str], int] = {}  # (user, name) -> adapter id
        self._next_id = 1

    # -- wire operations (``adapter_<name>``) --------------------------------------------------------------------

    async def create(
        self,
        session: Session,
        name: str,
        rank: int = 8,
        alpha: float = 16.0,
        targets: Sequence[str] = DEFAULT_TARGETS,
        sigma: float = DEFAULT_SIGMA,
    ) -> dict:
        """A fresh adapter under ``name`` in the user's namespace (PEFT's init: it changes nothing until trained or
        loaded); returns what ``open`` returns."""
        key = self._key(session, name)
        if key in self._ids:
            raise ValueError(f"adapter {name!r} already exists for user {session.username!r}: open it instead")
        for label, value in (("LoRA alpha", alpha), ("zo sigma", sigma)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{label} must be a number, got {value!r}")
        if not isinstance(targets, (list, tuple)):
            raise ValueError(f"LoRA target modules must be a list of module names, got {targets!r}")
        config = LoraConfig(rank, float(alpha), tuple(targets))
        self._check_quota(session.username, config, adapter_bytes(self.runner.cfg, config))
        adapter_id = self._next_id
        self.runner.create_adapter(adapter_id, config, float(sigma))
        return await self._publish(adapter_id, key)

    async def open(self, session: Session, name: str) -> dict | None:
        """The user's adapter ``name`` (an ``AdapterReply``), or None."""
        key = self._key(session, name)
        adapter_id = self._ids.get(key)
        if adapter_id is None and self.directory is not None:  # made on another replica: copy it here
            found = await self.directory.open_adapter(*key)
            adapter_id = None if found is None else self._ids.get(key) or self._copy_here(key, found)
        return None if adapter_id is None else self._describe(adapter_id)

    async def fork(self, session: Session, adapter: int, new_name: str) -> dict:
        key = self._key(session, new_name)
        if key in self._ids:
            raise ValueError(f"adapter {new_name!r} already exists for user {session.username!r}")
        source = self.owned(session, adapter)
        self._check_quota(session.username, self.runner.adapters.get(adapter).config, source.size)
        adapter_id = self._next_id
        self.runner.fork_adapter(adapter, adapter_id)
        return await self._publish(adapter_id, key)

    async def save(self, session: Session, adapter: int, path: str | None = None) -> None:
        """Write the adapter in PEFT's layout to ``path`` (default: its name) in the user's adapter directory. File
        I/O runs off the event loop (an adapter's matrices are never changed in place, so this is a snapshot)."""
        named = self.owned(session, adapter)
        path = named.name if path is None else path
        directory = user_path(self._root, session.username, path)
        weights = self.runner.adapters.get(adapter)
        try:
            await asyncio.to_thread(write_adapter, weights, directory, self.runner.model_dir)
        except OSError as e:
            raise ValueError(f"cannot save adapter {named.name!r} to {path!r}: {e.strerror}") from None
        if self.directory is not None:  # loadable from every node, not only this one's disk
            await self.directory.save_adapter_file(session.username, path, weights)

    async def load(self, session: Session, adapter: int, path: str) -> dict:
        """Replace the adapter's weights (and rank, alpha, targets) with the PEFT adapter at ``path``."""
        named = self.owned(session, adapter)
        directory = user_path(self._root, session.username, path)
        saved = None
        if not directory.is_dir() and self.directory is not None:  # saved on another node
            saved = await self.directory.load_adapter_file(session.username, path)
        if not directory.is_dir() and saved is None:
            raise ValueError(f"no adapter directory {path!r} in user {session.username!r}'s adapter directory")
        try:
            if saved is not None:
                config, weights = saved.config, saved.weights
            else:
                config, weights = await asyncio.to_thread(read_adapter, directory)
        except OSError as e:
            raise ValueError(f"cannot read adapter {path!r}: {e.strerror}") from None
        self.owned(session, adapter)  # still there after the read
        self._check_quota(session.username, config, weights_bytes(weights), replacing=named)
        before = self.runner.adapters.get(adapter)
        self.runner.replace_adapter(adapter, config, weights)
        named.salt, named.size = uuid.uuid4().bytes, weights_bytes(weights)  # KV under the old ones no longer matches
        if self.directory is not None:
            try:
                await self.directory.update_adapter(named.owner, named.name, self.runner.adapters.get(adapter))
            except QuotaExceeded:  # the directory cannot keep them: every copy stays as it was
                self.runner.replace_adapter(adapter, before.config, before.weights)
                named.size = weights_bytes(before.weights)
                raise
        return self._describe(adapter)

    async def destroy(self, session: Session, adapter: int) -> None:
        named = self.owned(session, adapter)
        self._drop(adapter)
        if self.directory is not None:
            await self.directory.destroy_adapter(named.owner, named.name)

    # -- from the directory: another replica destroyed the adapter, or loaded new weights into it ---------------

    def drop_named(self, user: str, name: str) -> None:
        adapter_id = self._ids.get((user, name))
        if adapter_id is not None:
            self._drop(adapter_id)

    def refresh_named(self, user: str, name: str, adapter: LoraAdapter) -> None:
        adapter_id = self._ids.get((user, name))
        if adapter_id is not None:
            self.runner.replace_adapter(adapter_id, adapter.config, adapter.weights)
            named = self._adapters[adapter_id]
            named.salt, named.size = uuid.uuid4().bytes, weights_bytes(adapter.weights)

    # -- for passes ----------------------------------------------------------------------------------------------

    def owned(self, session: Session, adapter: int) -> NamedAdapter:
        """The adapter, if it exists and belongs to the session's user."""
        named = self._adapters.get(adapter)
        if named is None or named.owner != session.username:
            raise ValueError(f"adapter {adapter!r} does not exist (it was destroyed, or belongs to another user)")
        return named

    def _key(self, session: Session, name: str) -> tuple[str, str]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        return session.username, name

    async def _publish(self, adapter_id: int, key: tuple[str, str]) -> dict:
        """Register a new adapter here and in the cluster's directory; a name taken on another replica is
        refused as it would be here (and the adapter just made is dropped)."""
        described = self._register(adapter_id, key)
        weights = self.runner.adapters.get(adapter_id)
        if self.directory is None:
            return described
        try:
            added = await self.directory.add_adapter(*key, weights)
        except BaseException:  # refused there (``adapter_store_bytes_per_user``), or no answer: not made here either
            self._drop(adapter_id)
            raise
        if not added:
            self._drop(adapter_id)
            raise ValueError(f"adapter {key[1]!r} already exists for user {key[0]!r}: open it instead")
        return described

    def _check_quota(self, user: str, config: LoraConfig, size: int, replacing: NamedAdapter | None = None) -> None:
        """Refuse (``QuotaExceeded``, or ValueError for a rank the model cannot use) an adapter of ``config`` and
        ``size`` bytes for ``user``, in place of ``replacing`` (a load) or as one more."""
        limits = self.limits
        if config.rank > limits.adapter_max_rank:
            raise QuotaExceeded(
                f"LoRA rank {config.rank} is over this cluster's limit: [limits] adapter_max_rank = "
                f"{limits.adapter_max_rank}"
            )
        check_rank(self.runner.cfg, config)
        mine = [a for a in self._adapters.values() if a.owner == user and a is not replacing]
        if replacing is None and len(mine) >= limits.adapters_per_user:
            raise QuotaExceeded(
                f"user {user!r} holds {len(mine)} adapters on this replica: [limits] adapters_per_user = "
                f"{limits.adapters_per_user} (destroy one first)"
            )
        held = sum(a.size for a in mine)
        if held + size > limits.adapter_bytes_per_user:
            raise QuotaExceeded(
                f"an adapter of {size} bytes would take user {user!r} to {held + size} bytes of adapter weights on "
                f"this replica: [limits] adapter_bytes_per_user = {limits.adapter_bytes_per_user}"
            )

    def _copy_here(self, key: tuple[str, str], adapter: LoraAdapter) -> int:
        """A copy of an adapter made on another replica."""
        self._check_quota(key[0], adapter.config, weights_bytes(adapter.weights))
        adapter_id = self._next_id
        self.runner.create_adapter(adapter_id, adapter.config, adapter.sigma)
        self.runner.replace_adapter(adapter_id, adapter.config, adapter.weights)
        self._register(adapter_id, key)
        return adapter_id

    def _drop(self, adapter_id: int) -> None:
        named = self._adapters.pop(adapter_id)
        self.runner.drop_adapter(adapter_id)
        del self._ids[named.owner, named.name]

    def _register(self, adapter_id: int, key: tuple[str, str]) -> dict:
        self._next_id += 1
        size = weights_bytes(self.runner.adapters.get(adapter_id).weights)
        self._adapters[adapter_id] = NamedAdapter(key[0], key[1], uuid.uuid4().bytes, size)
        self._ids[key] = adapter_id
        return self._describe(adapter_id)

    def _describe(self, adapter_id: int) -> dict:
        """The adapter's ``AdapterReply``, on the wire."""
        config = self.runner.adapters.get(adapter_id).config
        return encode(AdapterReply(adapter_id, config.rank, config.alpha, list(config.targets)))
