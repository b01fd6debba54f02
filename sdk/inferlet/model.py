"""``Model``: a handle on a served model — its tokenizer, its chat template, and the link to its replica."""

from __future__ import annotations

from inferlet._failover import ReplicaLink
from inferlet.instruct import Instruct
from inferlet.runtime import ModelEndpoint, Runtime, current
from inferlet.tokenizer import Tokenizer


class Model:
    def __init__(self, endpoint: ModelEndpoint, runtime: Runtime):
        self.name = endpoint.name
        self.endpoint = endpoint
        self.page_size = endpoint.page_size
        self._tokenizer = Tokenizer.from_dir(endpoint.model_dir)
        self.instruct = Instruct.from_dir(endpoint.model_dir)
        session = f"{runtime.capability}/{runtime.session.replace('/', '_')}"
        self.link = ReplicaLink(endpoint.name, endpoint.address, endpoint.failover, session)
        self.market_readings = None  # ``inferlet.scheduling``'s cache of the replica's market readings

    @staticmethod
    def load(name: str) -> Model:
        """Bind to a served model by its name (the ``name`` of a ``[[model]]`` entry in the cluster config)."""
        rt = current()
        if name not in rt.models_loaded:
            if name not in rt.endpoints:
                raise ValueError(f"unknown model {name!r}; this cluster serves: {', '.join(sorted(rt.endpoints))}")
            rt.models_loaded[name] = Model(rt.endpoints[name], rt)
        return rt.models_loaded[name]

    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def __repr__(self) -> str:
        return f"Model({self.name!r})"

    def close(self) -> None:
        """Release every context this inferlet holds on the replica (snapshots survive), then hang up. The runtime
        does this when the inferlet ends."""
        self.link.close()

    async def aclose(self) -> None:
        """``close``, awaited without holding the event loop (the runtime's ``aclose``)."""
        await self.link.aclose()
