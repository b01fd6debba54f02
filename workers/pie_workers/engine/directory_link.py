"""The engine's link to the cluster's directory of what users name (``pie_cluster.stores.directory``).

The cluster hands the engine the directory actor, the model's name and this replica's own actor (the holder of
what it saves). Snapshots: a save registers the name with its token lineage; an open or take that misses here asks
the directory and recomputes the snapshot from that lineage; a delete or take drops the name everywhere. Adapters:
creating one registers its weights, opening a name made elsewhere copies them here, loading new weights pushes them
to every copy, destroying drops every copy. Without a directory (``pie run``, tests of one replica) both are the
replica's own.
"""

from __future__ import annotations

from pie_workers.deadlines import DIRECTORY_S, answer
from pie_workers.engine.tenancy import QuotaExceeded

Text = list[tuple[int, int]]
Lineage = tuple[Text | None, int]  # (token, position) per token, or None if not recomputable; committed count


class DirectoryLink:
    def __init__(self, directory, model: str, holder):
        self._directory, self._model, self._holder = directory, model, holder
        self.model = model  # the name capabilities' model grants give this replica

    async def _ask(self, method: str, *args):
        """One call of the directory about this model, with a deadline (a hung directory fails the op, not the
        replica)."""
        ref = getattr(self._directory, method).remote(self._model, *args)
        try:
            return await answer(ref, "the user directory", DIRECTORY_S)
        except QuotaExceeded as e:  # refused there: its own message, not Ray's wrapping of it
            raise QuotaExceeded(str(getattr(e, "cause", None) or e)) from None

    async def register(self, user: str, name: str, lineage: Lineage | None) -> bool:
        """False if another replica already holds a snapshot of this name for this user."""
        text, committed = lineage if lineage is not None else (None, 0)
        return await self._ask("register", user, name, self._holder, text, committed)

    async def rehome(self, user: str, name: str) -> None:
        """The snapshot's pages are here now (a replica that left handed them over): this replica holds it."""
        await self._ask("rehome", user, name, self._holder)

    async def lookup(self, user: str, name: str) -> Lineage | None:
        return await self._ask("lookup", user, name)

    async def remove(self, user: str, name: str) -> Lineage | None:
        """Forget the name; the replica holding it (if not this one) drops its pages."""
        return await self._ask("remove", user, name, self._holder)

    async def add_adapter(self, user: str, name: str, adapter) -> bool:
        """False if the name is taken (an adapter of this user on any replica); ``QuotaExceeded`` past the user's
        ``adapter_store_bytes_per_user`` (as for ``update_adapter`` and ``save_adapter_file``)."""
        return await self._ask("add_adapter", user, name, adapter, self._holder)

    async def open_adapter(self, user: str, name: str):
        """The adapter's current weights (a ``LoraAdapter``) for a copy here, or None."""
        return await self._ask("open_adapter", user, name, self._holder)

    async def update_adapter(self, user: str, name: str, adapter) -> None:
        await self._ask("update_adapter", user, name, adapter, self._holder)

    async def destroy_adapter(self, user: str, name: str) -> None:
        await self._ask("destroy_adapter", user, name, self._holder)

    async def save_adapter_file(self, user: str, path: str, adapter) -> None:
        await self._ask("save_adapter_file", user, path, adapter)

    async def load_adapter_file(self, user: str, path: str):
        return await self._ask("load_adapter_file", user, path)
