"""State that outlives the actor holding it: entries in the GCS's key-value store.

Ray restarts an actor created with ``max_restarts`` when its process dies, but the new process starts from its
constructor; what it must not forget (the directory's names, the market's wallets) is written here as it changes
and read back when ``ray.get_runtime_context().was_current_actor_reconstructed``. The GCS keeps the store in
memory, or in Redis with GCS fault tolerance, so with that it also outlives the GCS's own restart.
"""

from __future__ import annotations

import json
from typing import Any

import ray.cloudpickle
from ray.experimental import internal_kv


class GcsStore:
    """Values by key (a tuple of strings, or a string) under ``prefix`` in the KV namespace ``namespace``."""

    def __init__(self, namespace: str, prefix: str):
        self._namespace, self._prefix = namespace, f"{prefix}/"

    def put(self, key: tuple | str, value: Any) -> None:
        name = self._prefix + json.dumps(key)
        internal_kv._internal_kv_put(name, ray.cloudpickle.dumps(value), overwrite=True, namespace=self._namespace)

    def get(self, key: tuple | str) -> Any | None:
        value = internal_kv._internal_kv_get(self._prefix + json.dumps(key), namespace=self._namespace)
        return None if value is None else ray.cloudpickle.loads(value)

    def delete(self, key: tuple | str) -> None:
        internal_kv._internal_kv_del(self._prefix + json.dumps(key), namespace=self._namespace)

    def load(self) -> dict[tuple | str, Any]:
        """Every entry, by key (a tuple, or a string where it was put with one)."""
        entries = {}
        for name in internal_kv._internal_kv_list(self._prefix, namespace=self._namespace):
            value = internal_kv._internal_kv_get(name, namespace=self._namespace)
            if value is not None:
                key = json.loads(name.decode()[len(self._prefix) :])
                entries[tuple(key) if isinstance(key, list) else key] = ray.cloudpickle.loads(value)
        return entries

    def clear(self) -> None:
        for name in internal_kv._internal_kv_list(self._prefix, namespace=self._namespace):
            internal_kv._internal_kv_del(name, namespace=self._namespace)


class DurableDict(dict):
    """A dict that writes each change through to its ``GcsStore``: what a restarted actor reads back."""

    def __init__(self, stored: GcsStore, restarted: bool):
        super().__init__(stored.load() if restarted else {})
        if not restarted:
            stored.clear()  # a fresh cluster's actor: what an earlier one left is not its own
        self.stored = stored

    def __setitem__(self, key: tuple | str, value: Any) -> None:
        super().__setitem__(key, value)
        self.stored.put(key, value)

    def pop(self, key: tuple | str, *default):
        if key in self:
            self.stored.delete(key)
        return super().pop(key, *default)

    def changed(self, key: tuple | str) -> None:
        """An entry's value was changed in place."""
        self.stored.put(key, self[key])
