"""DDP or FSDP2 applied to a built model from outside; the process group itself is ``seqlab.runtime.dist``.

FSDP shards each transformer block on its own (then the root), so blocks are found through the model's explicit
``blocks`` attribute, never by class name.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from seqlab.runtime.dist import DistInfo


def wrap_model(model: nn.Module, mode: str, info: DistInfo) -> nn.Module:
    """DDP, or FSDP2 (``fully_shard`` on every block of ``model.blocks``, then on the root). A no-op with one
    process."""
    if not info.active or mode == "none":
        return model
    if mode == "ddp":
        return DistributedDataParallel(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    if mode == "fsdp":
        # heavy (DTensor and its op tables take seconds to import): only FSDP runs need them
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in getattr(model, "blocks", ()):
            if any(p.numel() for p in block.parameters()):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"TrainConfig.parallel: unknown mode {mode!r}")


def set_grad_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch: skip the gradient all-reduce on all but the last micro-batch of a step."""
    if hasattr(model, "no_sync") and not enabled:
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
