"""torch.distributed glue: process group from torchrun's environment, DDP / FSDP2 wrapping, small collectives.

Everything degrades to a no-op with one process, so the trainer has a single code path. Collectives here move
only tensors (no ``*_object`` calls, which pickle): RNG states travel as padded byte tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes (RANK / WORLD_SIZE / LOCAL_RANK); gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    here = False
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
        here = True
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, initialized_here=here)


def shutdown(info: DistInfo) -> None:
    if info.initialized_here and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.active:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def gather_bytes(payload: bytes, info: DistInfo, device: torch.device) -> list[bytes]:
    """Every rank's ``payload`` on every rank, in rank order, via two tensor collectives."""
    if not info.active:
        return [payload]
    n = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(info.world_size)]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    bufs = [torch.zeros_like(buf) for _ in range(info.world_size)]
    dist.all_gather(bufs, buf)
    return [bytes(b[: int(s.item())].cpu().tolist()) for b, s in zip(bufs, sizes)]


def broadcast_int(value: int, info: DistInfo, device: torch.device) -> int:
    if not info.active:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def broadcast_float(value: float, info: DistInfo, device: torch.device) -> float:
    """Rank 0's value everywhere: decisions that depend on a clock (time budgets, timed evals) must agree."""
    if not info.active:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def wrap_model(model: nn.Module, mode: str, info: DistInfo, device: torch.device) -> nn.Module:
    """DDP, or FSDP2 (``fully_shard`` on every block, then on the root). A no-op with one process."""
    if not info.active or mode == "none":
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [info.local_rank] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if mode == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6 kept FSDP2 under _composable
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (info.world_size,))
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and m is not model:
                for block in m:
                    if sum(p.numel() for p in block.parameters()) > 0 and type(block).__name__ == "Block":
                        fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"TrainConfig.parallel: unknown mode {mode!r}")


def set_grad_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch: skip the gradient all-reduce on all but the last micro-batch of a step."""
    import contextlib

    if hasattr(model, "no_sync") and not enabled:
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
