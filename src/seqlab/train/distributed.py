"""DDP or FSDP2 applied to a built model from outside; the process group itself is ``seqlab.runtime.dist``.

FSDP shards each transformer block on its own (then the root), so blocks are found through the model's explicit
``blocks`` attribute, never by class name.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from seqlab.runtime.dist import DistInfo, all_reduce_sum
from seqlab.runtime.errors import CheckpointError


def wrap_model(model: nn.Module, mode: str, info: DistInfo) -> nn.Module:
    """DDP, or FSDP2 (``fully_shard`` on every block of ``model.blocks``, then on the root). A no-op with one
    process; ``"none"`` with several is refused: each process would train its own copy on its share of the batch."""
    if not info.active:
        return model
    if mode == "none":
        raise ValueError(f"--parallel none with {info.world_size} processes would train {info.world_size} "
                         "unsynchronised copies of the model, each on its share of every batch: use --parallel ddp "
                         "or fsdp, or run one process")
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


def load_full_weights(model: nn.Module, weights: dict[str, Tensor], where: str) -> None:
    """A checkpoint's full (unsharded) weights into ``model``, plain, DDP or FSDP-sharded.

    A module shared under two names (seq2seq's one embedding as ``shared``, ``encoder.embed.tok`` and
    ``decoder.embed.tok``; a tied LM head) is loaded under its first name only: torch's full-state-dict loader visits
    a shared module once and shards only that name's tensor, so a copy under a second name reached the sharded
    parameter unsharded and the load failed. The other names share the parameter, so nothing is left unloaded.
    """
    import torch.distributed.checkpoint.state_dict as sd_api  # heavy (seconds): only save/load need it

    first = {id(p): name for name, p in model.named_parameters()}  # each parameter once, under its first name
    aliases = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    # counted here: torch's loader fills the keys it misses into the dict it is given, from the model itself, so
    # its own missing_keys is always empty and a checkpoint without a tensor resumed on the fresh initialisation
    missing = sorted(set(model.state_dict()) - aliases - set(weights))
    options = sd_api.StateDictOptions(full_state_dict=True, strict=False)
    result = sd_api.set_model_state_dict(model, {k: v for k, v in weights.items() if k not in aliases},
                                         options=options)
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(f"{where}: the weights do not fit the model (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]})")


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, where: str) -> None:
    """A checkpoint's full optimizer state into ``optimizer``, after checking each slot against its parameter.

    Why check: the fused AdamW step trusts the slots' shapes, so a state whose ``exp_avg`` was resized (its hash
    re-recorded) read and wrote past the tensor's end, and a missing ``exp_avg_sq`` came back as zeros.
    """
    import torch.distributed.checkpoint.state_dict as sd_api  # heavy (seconds): only save/load need it

    params = dict(model.named_parameters())
    required = {"step", "exp_avg", "exp_avg_sq"} if isinstance(optimizer, torch.optim.AdamW) else set()
    for name, slots in (state.get("state") or {}).items():
        p = params.get(name)
        if p is None or not isinstance(slots, dict):
            raise CheckpointError(f"{where}: the optimizer state names {name!r}, which is no parameter of the model")
        lacking = sorted(required - set(slots))
        if lacking:
            raise CheckpointError(f"{where}: the optimizer state of {name!r} has no {', '.join(lacking)}")
        for slot, t in slots.items():
            want = () if slot == "step" else tuple(p.shape)
            if isinstance(t, Tensor) and tuple(t.shape) == want and t.is_floating_point():
                continue
            got = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise CheckpointError(f"{where}: the optimizer's {slot} of {name!r} is {got}; its parameter needs a "
                                  f"float tensor of shape {want}")
    sd_api.set_optimizer_state_dict(model, optimizer, state,
                                    options=sd_api.StateDictOptions(full_state_dict=True, strict=True))


def share_tied(model: nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` (a full state dict) with each tied parameter's other names pointing at its first name's tensor.
    An FSDP gather returns separate copies, which the checkpoint then stored twice (a tied head at 1.2x the size);
    the same tensor under two names is stored once, as one process stores it."""
    first = {id(p): name for name, p in model.named_parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first[id(p)] != name and name in weights and first[id(p)] in weights:
            weights[name] = weights[first[id(p)]]
    return weights


def seed_rank_stream(seed: int, salt: int, info: DistInfo) -> None:
    """Give this rank its own torch random stream (dropout draws from it): one seed on every rank gave every rank
    the same dropout masks, unlike one process over the whole batch. ``salt`` tells apart re-seedings (a resume's
    step)."""
    torch.manual_seed((seed * 1_000_003 + salt * 7_919 + info.rank) % 2**63)


def pooled_metrics(sums: dict[str, float], weights: dict[str, int], info: DistInfo,
                   device: torch.device) -> dict[str, float]:
    """An objective's step metrics (DPO's reward margin, a seq2seq's accuracy) pooled over every rank, each weighted
    as in one process; every rank reports the same metric names for the same objective."""
    names = sorted(sums)
    if info.active:
        t = torch.tensor([sums[k] for k in names] + [float(weights[k]) for k in names], dtype=torch.float64,
                         device=device)
        all_reduce_sum(t, info)
        values = t.tolist()
        sums, weights = dict(zip(names, values[: len(names)])), dict(zip(names, values[len(names):]))
    return {k: sums[k] / max(weights[k], 1) for k in names}
