"""safetensors in and out, for every model format of the edge: atomic writes, strict and checked loads.

Shared by seqlab's own folders, HF import and GGUF import, so none of those modules imports another to reach
these helpers. A load refuses what would otherwise run silently wrong: unreadable files, tensors that do not
match the model, and non-finite weights (a NaN in one weight turns every output into garbage).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from seqlab.runtime import CheckpointError
from seqlab.runtime.files import atomic_path, read_json_object


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied parameters stored once (safetensors refuses aliased tensors)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr() if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (corrupted or truncated?): {e}") from e


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse NaN/inf weights, naming the first tensor that has any (corruption, or a diverged run)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{source}: tensor {name!r} has {bad} non-finite values (NaN/inf); "
                                  "the file is corrupted or the run diverged, refusing to load it")


def load_state_into(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Strict load that names every missing, unexpected or mis-shaped tensor, and refuses non-finite weights."""
    expected = model.state_dict()
    tied = {n for n in expected if n not in tensors and _is_tied(model, n)}
    missing = sorted(set(expected) - set(tensors) - tied)
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = sorted(f"{n}: file {tuple(tensors[n].shape)} vs model {tuple(expected[n].shape)}"
                        for n in set(tensors) & set(expected) if tensors[n].shape != expected[n].shape)
    if missing or unexpected or mismatched:
        raise CheckpointError(f"{source}: tensors do not match the model: missing={missing} "
                              f"unexpected={unexpected} shape_mismatch={mismatched}")
    check_finite(tensors, source)
    model.load_state_dict(tensors, strict=False)


def _is_tied(model: nn.Module, name: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        return False
    return any(other != name and p is params[name] for other, p in params.items())


def read_config_json(path: Path) -> dict:
    """A JSON object from ``path``; any problem is a CheckpointError naming the file (and line)."""
    return read_json_object(path, CheckpointError)
