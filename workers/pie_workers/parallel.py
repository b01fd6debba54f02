"""The tensor-parallel group one rank belongs to, and the few collectives the model needs.

With ``world_size == 1`` every collective is a no-op, so the same model code runs unsharded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard_range(self, size: int) -> tuple[int, int]:
        """This rank's [start, end) of a dimension split evenly across the group."""
        if size % self.world_size:
            raise ValueError(f"dimension {size} is not divisible by tensor-parallel size {self.world_size}")
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on the leader; followers get None."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_leader else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def gather_ranks(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` (all of one shape) stacked along a new dim 1 on the leader; followers get None."""
        if self.world_size == 1:
            return x.unsqueeze(1)
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_leader else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.stack(parts, dim=1) if parts is not None else None

    def scatter_ranks(self, x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """``gather_ranks``'s inverse: the leader's ``x[:, r]`` to each rank ``r``; followers pass None, and every
        rank ``like``, a tensor of its part's shape, dtype and device."""
        if self.world_size == 1:
            return x[:, 0]
        mine = torch.empty_like(like)
        parts = [x[:, r].contiguous() for r in range(self.world_size)] if self.is_leader else None
        dist.scatter(mine, parts, src=0)
        return mine

    def broadcast_object(self, obj: Any = None) -> Any:
        """Send ``obj`` from the leader to every rank; returns what the leader sent."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> TensorParallel:
    """Join a torch.distributed group (gloo on CPU, NCCL on GPU); world size 1 needs no group."""
    if world_size > 1:
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    return TensorParallel(rank, world_size)
