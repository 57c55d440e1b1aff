"""Process-group glue for NNQS runs under torchrun (gloo on CPU); a no-op with one process.

Kept here rather than borrowed from ``seqlab.train`` so that VMC does not import the trainer: all it needs is
rank/world size and a summing all-reduce of tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over ranks (identity with one process)."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_from_env() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")  # seqlab.nnqs runs on CPU
        owns = True
    return Dist(dist.get_rank(), dist.get_world_size(), owns)
