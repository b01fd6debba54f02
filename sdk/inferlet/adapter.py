"""``Adapter``: a LoRA adapter on a model's replica, applied per forward pass (``adapter=`` on ``generate``,
``fwd.adapter(a)``), possibly perturbed for one pass by a zo (Evolution Strategies) seed.

Adapters are named per user, like snapshots: one made by an inferlet stays on the replica after it ends, for
``Adapter.open`` to find, until ``destroy()`` (or the end of a ``with`` block) drops it. ``save``/``load`` use PEFT's
layout (``adapter_config.json`` + ``adapter_model.safetensors``) in the user's adapter directory on the replica's
node (``$PIE_CACHE_DIR/adapters/<user>/``, paths relative to it), so an adapter trained with PEFT loads here.
"""

from __future__ import annotations

from collections.abc import Sequence

from pie_workers.wire.messages import AdapterReply, decode

from inferlet.model import Model


def check_zo_seed(seed: int) -> int:
    """A zo seed is a 64-bit integer (as in Pie's ``zo.adapter-seed``)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 63:
        raise ValueError(f"zo_seed must be a 64-bit integer, got {seed!r}")
    return seed


class Adapter:
    def __init__(self, model: Model, description: dict, name: str):
        """``description``: the replica's ``AdapterReply`` for it, on the wire."""
        self._model = model
        self._name = name
        self._describe(description)
        self._destroyed = False

    def _describe(self, description: dict) -> None:
        reply = decode(AdapterReply, description)
        self._id, self._rank, self._alpha, self._targets = reply.id, reply.rank, reply.alpha, reply.targets

    # -- lifetime --------------------------------------------------------------------------------------------------

    @staticmethod
    def create(
        model: Model,
        name: str,
        *,
        rank: int = 8,
        alpha: float = 16.0,
        target_modules: Sequence[str] = ("q_proj", "v_proj"),
        sigma: float = 0.01,
    ) -> Adapter:
        """A new adapter named ``name`` (ValueError if the user already has one). PEFT's initialisation: A random,
        B zero, so it changes nothing until loaded. ``target_modules`` are any of q/k/v/o_proj, gate/up/down_proj;
        ``sigma`` scales the perturbation a zo seed applies."""
        if isinstance(target_modules, str):
            target_modules = [target_modules]
        description = model.link.call_sync("adapter_create", name, rank, alpha, list(target_modules), sigma)
        return Adapter(model, description, name)

    @staticmethod
    def open(model: Model, name: str) -> Adapter | None:
        """The user's adapter ``name``, or None if there is none."""
        description = model.link.call_sync("adapter_open", name)
        return None if description is None else Adapter(model, description, name)

    def fork(self, new_name: str) -> Adapter:
        """A copy of this adapter's current weights under ``new_name``."""
        return Adapter(self._model, self._model.link.call_sync("adapter_fork", self._live_id(), new_name), new_name)

    def destroy(self) -> None:
        """Drop the adapter from the replica (idempotent); its saved files stay."""
        if not self._destroyed:
            self._destroyed = True
            self._model.link.call_sync("adapter_destroy", self._id)

    def __enter__(self) -> Adapter:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    # -- files -----------------------------------------------------------------------------------------------------

    def save(self, path: str | None = None) -> None:
        """Write the adapter in PEFT's layout to ``path`` (default: its name) in your adapter directory."""
        self._model.link.call_sync("adapter_save", self._live_id(), path)

    def load(self, path: str) -> None:
        """Replace the weights — and rank, alpha and target modules — with the PEFT adapter at ``path``."""
        self._describe(self._model.link.call_sync("adapter_load", self._live_id(), path))

    # -- inspection ------------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def model(self) -> Model:
        return self._model

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def target_modules(self) -> list[str]:
        return list(self._targets)

    def __repr__(self) -> str:
        return f"Adapter({self._name!r}, rank={self._rank}, alpha={self._alpha}, targets={self._targets})"

    def _live_id(self) -> int:
        if self._destroyed:
            raise ValueError(f"adapter {self._name!r} was destroyed; it can no longer be used")
        return self._id

    def id_on(self, model: Model) -> int:
        """The id a forward pass on ``model`` sends (ValueError for another model's adapter, or one destroyed)."""
        if model is not self._model:
            raise ValueError(f"adapter {self._name!r} belongs to model {self._model.name!r}, not {model.name!r}")
        return self._live_id()
