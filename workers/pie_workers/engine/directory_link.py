"""The engine's link to the cluster's directory of snapshot names (``pie_cluster.snapshots``).

The cluster hands the engine the directory actor, the model's name and this replica's own actor (the holder of
what it saves). A save registers the name with its token lineage; an open or take that misses here asks the
directory and recomputes the snapshot from that lineage; a delete or take drops the name everywhere. Without a
directory (``pie run``, tests of one replica) snapshots are the replica's own, as before.
"""

from __future__ import annotations

Text = list[tuple[int, int]]
Lineage = tuple[Text | None, int]  # (token, position) per token, or None if not recomputable; committed count


class DirectoryLink:
    def __init__(self, directory, model: str, holder):
        self._directory, self._model, self._holder = directory, model, holder

    async def register(self, user: str, name: str, lineage: Lineage | None) -> bool:
        """False if another replica already holds a snapshot of this name for this user."""
        text, committed = lineage if lineage is not None else (None, 0)
        return await self._directory.register.remote(self._model, user, name, self._holder, text, committed)

    async def lookup(self, user: str, name: str) -> Lineage | None:
        return await self._directory.lookup.remote(self._model, user, name)

    async def remove(self, user: str, name: str) -> Lineage | None:
        """Forget the name; the replica holding it (if not this one) drops its pages."""
        return await self._directory.remove.remote(self._model, user, name, self._holder)
