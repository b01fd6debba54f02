"""The cluster's directory of what users name: snapshots and LoRA adapters, per user and model, across replicas.

**Snapshots.** A snapshot's KV pages live on the replica that saved it. The directory keeps, per name, that replica
(to drop its pages when the name is deleted or taken elsewhere) and the snapshot's token lineage (each token and its
position), from which any other replica of the model recomputes it when an inferlet there opens or takes the name.
So a name saved on node A opens on node B, and outlives the replica that saved it. A snapshot whose KV cannot be
recomputed (written under a custom attention mask, an adapter or a zo seed) opens only where it was saved.

**Adapters.** An adapter's weights live in every replica that uses it. The directory keeps the current weights of
each named adapter (and the PEFT files users saved, by path): opening the name on another replica makes a copy
there; loading new weights anywhere pushes them to every copy; destroying it anywhere drops every copy.

Defined outcomes: a name is unique per user and model cluster-wide (making a taken name fails, as on one replica);
an open racing a take or destroy sees the thing if the open reached the directory first, else nothing.

**Bounded.** Adapter weights and saved files are kept in the GCS, so each user's total there (every model) is held to
``[limits] adapter_store_bytes_per_user``, and each user's snapshot names per model to ``snapshots_per_user`` (a
replica bounds those it holds; this bounds the lineages kept here, of snapshots let go of too): past either, what
was asked is refused (``QuotaExceeded``, raised in the inferlet that asked) and nothing of it is kept; no other
user's entries are touched.

**Durable.** Every entry is also written to the GCS's key-value store (``GcsStore``), and Ray restarts the directory
when its process dies: the restarted one reads its entries back, so snapshots and adapters outlive it (and, with
GCS fault tolerance, the GCS's own restart). A call in flight when it died fails with Ray's error; the next one is
answered by the restarted directory. A directory created fresh (``pie start``) starts empty.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import ray
from pie_workers.engine.tenancy import QuotaExceeded

from pie_cluster.gcs_store import DurableDict, GcsStore

DIRECTORY = "pie-directory"

Text = list[tuple[int, int]]  # (token, position) of each token, in order
Key = tuple[str, str, str]  # (model, user, name)


@dataclass
class _Snapshot:
    holder: object  # the rank-0 actor of the replica whose pool holds the pages
    text: Text | None  # None: not recomputable elsewhere
    committed: int


@dataclass
class _Adapter:
    adapter: object  # pie_workers.adapters.LoraAdapter: its configuration, weights and zo sigma
    holders: list = field(default_factory=list)  # rank-0 actors of the replicas holding a copy


class UserDirectory:
    def __init__(self, namespace: str = "pie", store_bytes_per_user: int = 1 << 30, snapshots_per_user: int = 1024):
        """``store_bytes_per_user``: the bytes of adapter weights and files one user may keep here;
        ``snapshots_per_user``: the snapshot names one user may have per model."""
        restarted = ray.get_runtime_context().was_current_actor_reconstructed

        def entries(kind: str) -> DurableDict:
            return DurableDict(GcsStore(f"pie-directory/{namespace}", kind), restarted)

        self._snapshots = entries("snapshots")
        self._adapters = entries("adapters")
        self._adapter_files = entries("adapter-files")  # (model, user, path) -> the adapter saved there
        self._store_bytes_per_user = store_bytes_per_user
        self._snapshots_per_user = snapshots_per_user
        self._named: Counter[tuple[str, str]] = Counter(key[:2] for key in self._snapshots)  # (model, user) -> names
        self._stored: Counter[str] = Counter()  # user -> bytes of their adapters and files above
        for (_, user, _), entry in self._adapters.items():
            self._stored[user] += entry.adapter.nbytes
        for (_, user, _), adapter in self._adapter_files.items():
            self._stored[user] += adapter.nbytes

    # -- snapshots ---------------------------------------------------------------------------------------------

    async def register(self, model: str, user: str, name: str, holder, text: Text | None, committed: int) -> bool:
        """Record a saved snapshot; False if the name is taken (by a snapshot on any replica)."""
        key = (model, user, name)
        if key in self._snapshots:
            return False
        if self._named[model, user] >= self._snapshots_per_user:
            raise QuotaExceeded(
                f"user {user!r} has {self._named[model, user]} snapshots of model {model!r} in the cluster: [limits] "
                f"snapshots_per_user = {self._snapshots_per_user} (delete one first)"
            )
        self._snapshots[key] = _Snapshot(holder, text, committed)
        self._named[model, user] += 1
        return True

    async def rehome(self, model: str, user: str, name: str, holder) -> None:
        """The snapshot's pages moved to ``holder`` (the replica that held them left and handed them over)."""
        entry = self._snapshots.get((model, user, name))
        if entry is not None:
            self._snapshots[model, user, name] = _Snapshot(holder, entry.text, entry.committed)

    async def lookup(self, model: str, user: str, name: str) -> tuple[Text | None, int] | None:
        """The lineage to recompute the snapshot from: (text, committed), text None when it cannot be recomputed;
        None when there is no such snapshot."""
        entry = self._snapshots.get((model, user, name))
        return None if entry is None else (entry.text, entry.committed)

    async def remove(self, model: str, user: str, name: str, by=None) -> tuple[Text | None, int] | None:
        """Forget the name (deleted or taken, by replica ``by``); the holder drops its pages unless it is ``by``.
        Returns what ``lookup`` would have (None: there was no such snapshot)."""
        entry = self._snapshots.pop((model, user, name), None)
        if entry is None:
            return None
        self._named[model, user] -= 1
        if entry.holder != by:
            _tell(entry.holder, "drop_snapshot", user, name)
        return entry.text, entry.committed

    async def release(self, model: str, user: str, name: str) -> None:
        """The holder frees the snapshot's pages while the name stays, to be recomputed from its lineage wherever it
        is opened next: its committed pages become the holder's prefix cache, reused by that recompute while they
        last and evicted, least recently used first, when memory runs short. A snapshot that cannot be recomputed
        keeps its pages."""
        entry = self._snapshots.get((model, user, name))
        if entry is not None and entry.text is not None:
            _tell(entry.holder, "drop_snapshot", user, name)

    # -- adapters ----------------------------------------------------------------------------------------------

    async def add_adapter(self, model: str, user: str, name: str, adapter, holder) -> bool:
        """Record a new adapter made on ``holder``; False if the name is taken."""
        key = (model, user, name)
        if key in self._adapters:
            return False
        self._charge(user, adapter, None, f"adapter {name!r}")
        self._adapters[key] = _Adapter(adapter, [holder])
        return True

    async def open_adapter(self, model: str, user: str, name: str, holder):
        """The adapter's current weights for a copy on ``holder`` (which from now on gets its updates), or None."""
        entry = self._adapters.get((model, user, name))
        if entry is None:
            return None
        if holder not in entry.holders:
            entry.holders.append(holder)
            self._adapters.changed((model, user, name))
        return entry.adapter

    async def update_adapter(self, model: str, user: str, name: str, adapter, by) -> None:
        """New weights for the adapter (loaded on ``by``): every other copy gets them."""
        entry = self._adapters.get((model, user, name))
        if entry is None:
            return
        self._charge(user, adapter, entry.adapter, f"adapter {name!r}")
        entry.adapter = adapter
        self._adapters.changed((model, user, name))
        for holder in entry.holders:
            if holder != by:
                _tell(holder, "refresh_adapter", user, name, adapter)

    async def destroy_adapter(self, model: str, user: str, name: str, by) -> None:
        """The adapter is gone: every copy but ``by``'s (which destroyed its own) is dropped."""
        entry = self._adapters.pop((model, user, name), None)
        if entry is not None:
            self._stored[user] -= entry.adapter.nbytes
        for holder in entry.holders if entry is not None else ():
            if holder != by:
                _tell(holder, "drop_adapter", user, name)

    async def save_adapter_file(self, model: str, user: str, path: str, adapter) -> None:
        """What the user saved at ``path``, so that loading it works on every node, not only the one that wrote it."""
        self._charge(user, adapter, self._adapter_files.get((model, user, path)), f"the adapter file {path!r}")
        self._adapter_files[(model, user, path)] = adapter

    async def load_adapter_file(self, model: str, user: str, path: str):
        return self._adapter_files.get((model, user, path))

    def _charge(self, user: str, adapter, replaced, what: str) -> None:
        """Count ``adapter`` (in place of ``replaced``, if any) against the user's bytes here, or refuse it."""
        size, freed = adapter.nbytes, 0 if replaced is None else replaced.nbytes
        total = self._stored[user] - freed + size
        if total > self._store_bytes_per_user:
            raise QuotaExceeded(
                f"{what} ({size} bytes) would take user {user!r} to {total} bytes of adapters kept in the cluster's "
                f"store: [limits] adapter_store_bytes_per_user = {self._store_bytes_per_user}"
            )
        self._stored[user] = total


def _tell(replica, method: str, *args) -> None:
    """Ask a replica to drop or refresh its copy; a dead one has nothing left to drop."""
    with contextlib.suppress(ray.exceptions.RayError):
        getattr(replica, method).remote(*args)


def get_or_create_directory(
    namespace: str,
    lifetime: str | None = None,
    placement: dict | None = None,
    store_bytes_per_user: int = 1 << 30,
    snapshots_per_user: int = 1024,
):
    """The directory of ``namespace``, restarted by Ray whenever its process dies (its entries are durable);
    ``store_bytes_per_user``, ``snapshots_per_user``: those of ``[limits]`` (``adapter_store_bytes_per_user``)."""
    options = {
        "name": DIRECTORY,
        "namespace": namespace,
        "get_if_exists": True,
        "lifetime": lifetime,
        "num_cpus": 0,
        "max_restarts": -1,
    }
    directory = ray.remote(UserDirectory).options(**options, **(placement or {}))
    return directory.remote(namespace, store_bytes_per_user, snapshots_per_user)
