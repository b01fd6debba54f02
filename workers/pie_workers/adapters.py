"""The LoRA adapters one rank holds, their shards for the forward, and their zo (Evolution Strategies) perturbations.

Every rank of a tensor-parallel group holds the same adapters under the same ids: the leader applies each change,
then broadcasts it in order with the batches (see ``ModelRunner``). Each rank keeps the full PEFT matrices (small next
to the model), so saving, forking and perturbing need no gather, and derives its own shard for the forward
(``layers.lora``). A zo seed perturbs every matrix by ``sigma * N(0, 1)`` drawn on the CPU from the seed, so a seed
means the same perturbation on every rank, replica and device; a negative seed draws the mirrored perturbation of
its absolute value (antithetic pairs).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pie_workers.batch_plan import LoraGroup
from pie_workers.config import ModelConfig
from pie_workers.layers.lora import PEFT_MODULES, BatchLora, LoraPair, ModuleWeights, module_shapes, shard_for_rank
from pie_workers.parallel import TensorParallel

DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for the Llama family
DEFAULT_SIGMA = 0.01


@dataclass(frozen=True)
class LoraConfig:
    """What shapes an adapter: its rank, its scaling (``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA), and
    the PEFT modules it targets (kept in layer order). Invalid values raise ValueError on construction."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not math.isfinite(self.alpha):
            raise ValueError(f"LoRA alpha must be a finite number, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in PEFT_MODULES]
        if unknown or not self.targets:
            raise ValueError(
                f"LoRA target modules {list(self.targets)!r} are not a non-empty subset of {list(PEFT_MODULES)}"
            )
        object.__setattr__(self, "targets", tuple(m for m in PEFT_MODULES if m in self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank


@dataclass(frozen=True)
class LoraAdapter:
    """Full matrices (float32, CPU) per (layer, module), and the scale of its zo perturbations."""

    config: LoraConfig
    weights: ModuleWeights
    sigma: float = DEFAULT_SIGMA

    @property
    def nbytes(self) -> int:
        """What it costs its user's store quota (the directory reads it without importing this module)."""
        return weights_bytes(self.weights)


def initial_adapter(cfg: ModelConfig, config: LoraConfig, seed: int, sigma: float) -> LoraAdapter:
    """PEFT's default init: A kaiming-uniform like ``torch.nn.Linear``, B zero, so a new adapter changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    weights = {}
    for layer in range(cfg.num_layers):
        for module in config.targets:
            fan_in, fan_out = shapes[module]
            bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5))
            a = torch.empty(config.rank, fan_in).uniform_(-bound, bound, generator=gen)
            weights[layer, module] = (a, torch.zeros(fan_out, config.rank))
    return LoraAdapter(config, weights, sigma)


def check_rank(cfg: ModelConfig, config: LoraConfig) -> None:
    """Raise ValueError unless the rank is at most the smaller dimension of every module it adapts: a larger one
    only costs memory (the update's rank cannot exceed it), so at most the model's hidden size."""
    shapes = module_shapes(cfg)
    module = min(config.targets, key=lambda m: min(shapes[m]))
    if config.rank > min(shapes[module]):
        raise ValueError(
            f"LoRA rank {config.rank} exceeds this model's {module} ({shapes[module][0]} -> {shapes[module][1]}): "
            f"a rank is at most {min(shapes[module])} here"
        )


def adapter_bytes(cfg: ModelConfig, config: LoraConfig) -> int:
    """Bytes of the float32 matrices an adapter of ``config`` holds on this model (known before making it)."""
    shapes = module_shapes(cfg)
    return 4 * cfg.num_layers * config.rank * sum(sum(shapes[m]) for m in config.targets)


def weights_bytes(weights: ModuleWeights) -> int:
    """Bytes of an adapter's matrices as they are held."""
    return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in weights.values())


def check_fits(cfg: ModelConfig, adapter: LoraAdapter) -> None:
    """Raise ValueError naming the first matrix that does not fit this model or the adapter's own rank/targets."""
    if not adapter.weights:
        raise ValueError("the adapter has no LoRA matrices")
    check_rank(cfg, adapter.config)
    if not (math.isfinite(adapter.sigma) and adapter.sigma >= 0):
        raise ValueError(f"zo sigma must be a finite number >= 0, got {adapter.sigma!r}")
    shapes, config = module_shapes(cfg), adapter.config
    for (layer, module), (a, b) in adapter.weights.items():
        where = f"layer {layer} {module}"
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"{where}: the model has {cfg.num_layers} layers")
        if module not in config.targets:
            raise ValueError(f"{where}: not among the adapter's target modules {list(config.targets)}")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (config.rank, fan_in) or tuple(b.shape) != (fan_out, config.rank):
            raise ValueError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match rank {config.rank} on "
                f"this model's {module} ({fan_in} -> {fan_out}): expected {(config.rank, fan_in)} / "
                f"{(fan_out, config.rank)}"
            )


def perturbed(adapter: LoraAdapter, seed: int) -> ModuleWeights:
    """The adapter's matrices plus ``sign(seed) * sigma * N(0, 1)``; each matrix draws from its own stream, so the
    noise of a matrix does not depend on which other modules the adapter targets."""
    sign, base = (-1.0, -seed) if seed < 0 else (1.0, seed)
    out = {}
    for (layer, module), (a, b) in adapter.weights.items():
        stream = (layer * len(PEFT_MODULES) + PEFT_MODULES.index(module)) * 2
        noise_a = torch.randn(a.shape, generator=torch.Generator().manual_seed(_mix(base, stream)))
        noise_b = torch.randn(b.shape, generator=torch.Generator().manual_seed(_mix(base, stream + 1)))
        out[layer, module] = (a + sign * adapter.sigma * noise_a, b + sign * adapter.sigma * noise_b)
    return out


def _mix(seed: int, stream: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class AdapterStore:
    """Adapters by id on one rank, with each one's shard for this rank ready on the device.

    Perturbed shards are cached per (adapter, seed) — a Generator sends the same seed on every step — in a small LRU.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, device: torch.device, dtype: torch.dtype, zo_cache=16):
        self.cfg, self.tp, self.device, self.dtype = cfg, tp, device, dtype
        self._adapters: dict[int, LoraAdapter] = {}
        self._shards: dict[int, dict[tuple[int, str], LoraPair]] = {}
        self._perturbed: OrderedDict[tuple[int, int], dict[tuple[int, str], LoraPair]] = OrderedDict()
        self._zo_cache = zo_cache

    def ids(self) -> Iterable[int]:
        return self._adapters.keys()

    def get(self, adapter_id: int) -> LoraAdapter:
        if adapter_id not in self._adapters:
            raise ValueError(f"adapter {adapter_id} does not exist on this replica")
        return self._adapters[adapter_id]

    def put(self, adapter_id: int, adapter: LoraAdapter) -> None:
        """Add or replace an adapter (ValueError, and no change, if it does not fit the model)."""
        check_fits(self.cfg, adapter)
        shards = self._shard(adapter.weights, adapter.config.scale)
        self.drop(adapter_id)
        self._adapters[adapter_id], self._shards[adapter_id] = adapter, shards

    def create(self, adapter_id: int, config: LoraConfig, seed: int, sigma: float) -> None:
        self.put(adapter_id, initial_adapter(self.cfg, config, seed, sigma))

    def fork(self, src: int, dst: int) -> None:
        self.put(dst, self.get(src))  # matrices are never mutated in place, so sharing them is a copy

    def drop(self, adapter_id: int) -> None:
        self._adapters.pop(adapter_id, None)
        self._shards.pop(adapter_id, None)
        for key in [k for k in self._perturbed if k[0] == adapter_id]:
            del self._perturbed[key]

    def batch_lora(self, groups: list[LoraGroup]) -> BatchLora | None:
        """The pairs each group of the batch applies (None when no request uses an adapter)."""
        if not groups:
            return None
        return BatchLora([(g.rows, self._pairs(g.adapter, g.zo_seed)) for g in groups])

    def _pairs(self, adapter_id: int, seed: int | None) -> dict[tuple[int, str], LoraPair]:
        if seed is None:
            return self._shards[adapter_id]
        key = (adapter_id, seed)
        if key in self._perturbed:
            self._perturbed.move_to_end(key)
        else:
            adapter = self._adapters[adapter_id]
            self._perturbed[key] = self._shard(perturbed(adapter, seed), adapter.config.scale)
            if len(self._perturbed) > self._zo_cache:
                self._perturbed.popitem(last=False)
        return self._perturbed[key]

    def _shard(self, weights: ModuleWeights, scale: float) -> dict[tuple[int, str], LoraPair]:
        return shard_for_rank(weights, scale, self.cfg, self.tp, self.device, self.dtype)
