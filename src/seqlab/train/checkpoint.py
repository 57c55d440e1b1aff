"""Training checkpoints on the runtime's store: model weights, AdamW moments and the trainer's state.

Layout of ``<out>/checkpoints/step_00001000/``: ``model.safetensors`` (full weights, tied tensors once),
``optimizer.safetensors`` (tensors keyed ``"<param fqn>/<slot>"``), the model's ``config.json`` and the run's
tokenizer files (so the directory is a loadable model folder), and ``state.json`` with everything else and the
sha256 of every file. See ``seqlab.runtime.store`` for why it is written and read this way.

``resolve_checkpoint`` turns a path into the model folder it means (a run directory: its latest checkpoint);
``seqlab eval`` and every loader in ``seqlab.io`` use this one resolver.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

import seqlab
from seqlab.runtime.errors import CheckpointError
from seqlab.runtime.store import CheckpointStore, optimizer_dict_from_tensors, optimizer_dict_to_tensors

KIND = "seqlab-train-checkpoint"

__all__ = ["KIND", "CheckpointError", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "model_folder_files", "resolve_checkpoint", "save_checkpoint", "store"]


def store(root: str | os.PathLike, keep_last: int | None = None) -> CheckpointStore:
    return CheckpointStore(root, keep_last, kind=KIND)


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    return store(root).list()


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    return store(root).latest()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The model folder ``path`` means: itself (``config.json`` or ``state.json`` inside), or the latest
    ``step_*`` checkpoint of a run directory (``checkpoints/`` inside) or of a ``checkpoints/`` folder."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: expected a model folder, a checkpoint folder or a run directory, not a file")
    if (p / "checkpoints").is_dir():
        latest = latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise CheckpointError(f"{p / 'checkpoints'}: no checkpoint yet (no step_* folder)")
        return latest
    if (p / "metrics.jsonl").is_file() and not (p / "model.safetensors").is_file():  # a run folder's own files
        raise CheckpointError(f"{p}: a training run with no checkpoint yet (no checkpoints/step_*/)")
    if (p / "config.json").is_file() or (p / "state.json").is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(f"{p}: no model here (expected config.json, state.json, or checkpoints/step_*/)")
    return latest


def save_checkpoint(root: str | os.PathLike, step: int, model_sd: dict[str, torch.Tensor], optim_sd: dict | None,
                    state: dict[str, Any], keep_last: int | None = None,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write one checkpoint atomically (main rank only) and keep the newest ``keep_last``."""
    tensors = {"model": model_sd}
    state = dict(state)
    if optim_sd is not None:
        tensors["optimizer"], state["optimizer"] = optimizer_dict_to_tensors(optim_sd)
    return store(root, keep_last).save(step, tensors, state, files=extra_files)


def load_checkpoint(path: str | os.PathLike, load_optimizer: bool = True
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict | None]:
    """Read and verify a checkpoint: (state, model state dict, optimizer state dict or None)."""
    stems = ("model", "optimizer") if load_optimizer else ("model",)
    tensors, state = store(Path(path).parent).load(path, stems=stems)
    optim_sd = None
    if load_optimizer and "optimizer" in tensors:
        optim_sd = optimizer_dict_from_tensors(tensors["optimizer"], state["optimizer"])
    return state, tensors["model"], optim_sd


def model_folder_files(model_config: dict | None, out_dir: str | os.PathLike) -> dict[str, bytes]:
    """The files that make a checkpoint directory a loadable model folder: the seqlab ``config.json`` (so
    ``load_pretrained(checkpoint_dir)`` works) and the run's tokenizer files (its config keeps the chat template)."""
    files = {}
    if model_config is not None:
        doc = {"format": "seqlab", "seqlab_version": seqlab.__version__, "config": model_config}
        files["config.json"] = (json.dumps(doc, indent=2) + "\n").encode()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(out_dir) / name).is_file():
            files[name] = (Path(out_dir) / name).read_bytes()
    return files
