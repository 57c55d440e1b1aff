"""One process-group helper for every driver: torchrun's environment in, a ``DistInfo`` out.

Everything degrades to a no-op with one process, so a driver has a single code path. Collectives move only
tensors (no ``*_object`` calls, which pickle): variable-length payloads travel as padded byte tensors.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

SHUTDOWN_BARRIER_S = 60.0  # how long ``shutdown`` waits for the other ranks before destroying the group anyway


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False  # this process created the group, so it destroys it in ``shutdown``

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def collective_device(self) -> torch.device:
        """Where collective tensors live: the GPU under nccl, else the CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a device; a GPU that is not there is refused, not asserted."""
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: not a device (use auto, cpu, cuda or cuda:N)") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: seqlab runs on auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: this torch sees no CUDA GPU (use --device cpu or auto)")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        if dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def init_distributed(backend: str | None = None, device: str = "auto") -> DistInfo:
    """Join the group torchrun describes (RANK / WORLD_SIZE / LOCAL_RANK); nccl for a GPU, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return DistInfo(device=dev)
    owns = False
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend=backend or ("nccl" if dev.type == "cuda" else "gloo"))
        owns = True
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev,
                    owns_group=owns)


def set_cpu_threads(num_threads: int | None, info: DistInfo) -> None:
    """``num_threads`` if given; else, for several CPU processes on one machine, an equal share of the cores
    each (torch would otherwise give every process all cores, and they would fight over them)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    elif info.active and info.device.type == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def shutdown(info: DistInfo, timeout_s: float = SHUTDOWN_BARRIER_S) -> None:
    """Destroy the group this process made, after the ranks meet in a bounded barrier.

    Why the barrier: a rank that tore gloo down while its peer was still finishing aborted once under load
    (std::terminate in gloo's teardown, SIGABRT, in tests/train/test_distributed.py). Why bounded: ``shutdown``
    also runs in ``finally`` blocks: while an exception is on its way out the peer may be dead or stuck in a
    collective, so there is no barrier then, and otherwise gloo's monitored barrier gives up after ``timeout_s``
    and the group is destroyed anyway, instead of hanging the rank that is trying to exit.
    """
    if not (info.owns_group and dist.is_initialized()):
        return
    leaving_on_error = sys.exc_info()[0] is not None
    if info.active and dist.get_backend() == "gloo" and not leaving_on_error:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
        except RuntimeError:
            pass  # a peer failed or left first: nothing to wait for
    dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """In-place sum over ranks; returns ``t``."""
    if info.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """In-place mean over ranks; returns ``t``."""
    if info.active:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(info.world_size)
    return t


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if it is true on one (a stop request must end all ranks at the same step)."""
    if not info.active:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return bool(t.item() > 0)


def broadcast_float(value: float, info: DistInfo) -> float:
    """Rank 0's value everywhere: decisions that depend on a clock must agree across ranks."""
    if not info.active:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.collective_device)
    dist.broadcast(t, src=0)
    return float(t.item())


def gather_bytes(payload: bytes, info: DistInfo) -> list[bytes]:
    """Every rank's ``payload`` on every rank, in rank order, via two tensor collectives."""
    if not info.active:
        return [payload]
    device = info.collective_device
    n = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(info.world_size)]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    bufs = [torch.zeros_like(buf) for _ in range(info.world_size)]
    dist.all_gather(bufs, buf)
    return [bytes(b[: int(s.item())].cpu().tolist()) for b, s in zip(bufs, sizes)]
