"""AdamW with two parameter groups: matrices decay, everything else does not.

Weight decay pulls weights towards zero; on a bias, a norm gain or any other 1-D parameter that only shifts or
rescales, it just fights the optimum, so those (and embeddings' *tied* copies, counted once) go in a no-decay
group. Matrices, including the embedding table, decay (as in nanoGPT and Llama recipes).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from seqlab.train.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decay (dim >= 2) and no-decay (dim < 2) groups, each parameter once."""
    decay, no_decay, seen = [], [], set()
    decay_names, no_decay_names = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() >= 2:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    params = [{k: v for k, v in g.items() if k != "names"} for g in groups if g["params"]]
    # fused AdamW is one kernel per parameter on CUDA and on CPU (a few times faster there than foreach, see
    # docs/acceleration-measured.md); foreach stays the path elsewhere.
    device_type = next(model.parameters()).device.type
    if device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)
