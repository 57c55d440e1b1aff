"""Activation checkpointing applied from outside the model: recompute each block in the backward pass.

The core has no such switch and should not need one (torchtitan's rule: parallelism and memory tricks wrap the
model, they do not live in it). We replace the *instance* ``forward`` of every block found in a ``blocks``
ModuleList with one that runs the original under ``torch.utils.checkpoint``. Parameter names and the
state dict are unchanged, so checkpoints stay interchangeable with runs that did not recompute.

Only training passes are recomputed: with grad disabled (eval) or with a KV cache (decoding) the original
forward runs as is.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _block_lists(model: nn.Module) -> list[nn.ModuleList]:
    return [m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.split(".")[-1] == "blocks"]


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Wrap every transformer block; returns how many were wrapped (0 means the model has no ``blocks``)."""
    n = 0
    for blocks in _block_lists(model):
        for block in blocks:
            if getattr(block, "_seqlab_recompute", False):
                continue
            original = block.forward

            @functools.wraps(original)
            def forward(x, inputs, *args, _original=original, **kwargs):
                if torch.is_grad_enabled() and getattr(inputs, "cache", None) is None:
                    return checkpoint(_original, x, inputs, *args, use_reentrant=False, **kwargs)
                return _original(x, inputs, *args, **kwargs)

            block.forward = forward
            block._seqlab_recompute = True
            n += 1
    return n
