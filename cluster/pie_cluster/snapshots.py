"""The cluster's directory of named snapshots: one namespace of names per user and model, across every replica.

A snapshot's KV pages live on the replica that saved it. The directory keeps, per name, that replica (to drop its
pages when the name is deleted or taken elsewhere) and the snapshot's token lineage (each token and its position),
from which any other replica of the model recomputes it when an inferlet there opens or takes the name. So a name
saved on node A opens on node B, and outlives the replica that saved it. A snapshot whose KV cannot be recomputed
(written under a custom attention mask, an adapter or a zo seed) opens only on the replica that holds it.

Defined outcomes: a name is unique per user and model cluster-wide (saving a taken name fails, as on one replica);
an open racing a take sees the snapshot if the open reached the directory first, else nothing; deleting or taking
a name anywhere drops the saving replica's pages.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ray

DIRECTORY = "pie-snapshots"

Text = list[tuple[int, int]]  # (token, position) of each token, in order


@dataclass
class _Entry:
    holder: object  # the rank-0 actor of the replica whose pool holds the pages
    text: Text | None  # None: not recomputable elsewhere
    committed: int


class SnapshotDirectory:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], _Entry] = {}  # (model, user, name) -> entry

    async def register(self, model: str, user: str, name: str, holder, text: Text | None, committed: int) -> bool:
        """Record a saved snapshot; False if the name is taken (by a snapshot on any replica)."""
        key = (model, user, name)
        if key in self._entries:
            return False
        self._entries[key] = _Entry(holder, text, committed)
        return True

    async def lookup(self, model: str, user: str, name: str) -> tuple[Text | None, int] | None:
        """The lineage to recompute the snapshot from: (text, committed), text None when it cannot be recomputed;
        None when there is no such snapshot."""
        entry = self._entries.get((model, user, name))
        return None if entry is None else (entry.text, entry.committed)

    async def remove(self, model: str, user: str, name: str, by=None) -> tuple[Text | None, int] | None:
        """Forget the name (deleted or taken, by replica ``by``); the holder drops its pages unless it is ``by``.
        Returns what ``lookup`` would have (None: there was no such snapshot)."""
        entry = self._entries.pop((model, user, name), None)
        if entry is None:
            return None
        if by is None or entry.holder != by:
            with contextlib.suppress(ray.exceptions.RayError):  # a dead holder has no pages to drop
                entry.holder.drop_snapshot.remote(user, name)
        return entry.text, entry.committed

    async def count(self) -> int:
        return len(self._entries)


def get_or_create_directory(namespace: str):
    return (
        ray.remote(SnapshotDirectory)
        .options(name=DIRECTORY, namespace=namespace, get_if_exists=True, num_cpus=0)
        .remote()
    )
