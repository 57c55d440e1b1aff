"""seqlab's own model format: ``config.json`` + ``model.safetensors``. No pickle anywhere.

Writes are atomic (temporary file in the same folder, then ``os.replace``) so a crash mid-save never leaves a
half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

import seqlab
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.quant.checkpoint import load_quantized
from seqlab.runtime import CheckpointError, atomic_write_bytes, atomic_write_text

FORMAT = "seqlab"


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
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (corrupted or truncated?): {e}") from e


def load_state_into(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Strict load that names every missing, unexpected or mis-shaped tensor."""
    expected = model.state_dict()
    tied = {n for n in expected if n not in tensors and _is_tied(model, n)}
    missing = sorted(set(expected) - set(tensors) - tied)
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = sorted(f"{n}: file {tuple(tensors[n].shape)} vs model {tuple(expected[n].shape)}"
                        for n in set(tensors) & set(expected) if tensors[n].shape != expected[n].shape)
    if missing or unexpected or mismatched:
        raise CheckpointError(f"{source}: tensors do not match the model: missing={missing} "
                              f"unexpected={unexpected} shape_mismatch={mismatched}")
    model.load_state_dict(tensors, strict=False)


def _is_tied(model: nn.Module, name: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        return False
    return any(other != name and p is params[name] for other, p in params.items())


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (atomically) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(unique_state_dict(model), out / "model.safetensors", metadata={"format": "pt"})
    doc = {"format": FORMAT, "seqlab_version": seqlab.__version__, "config": model.config.to_dict()}
    atomic_write_text(out / "config.json", json.dumps(doc, indent=2) + "\n")
    return out


def read_config_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return doc


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """Load a folder written by ``save_pretrained``; a Hugging Face folder is handed to ``load_hf``."""
    folder = Path(path)
    doc = read_config_json(folder / "config.json")
    if doc.get("format") != FORMAT:
        from seqlab.io.hf import load_hf

        return load_hf(folder, dtype=dtype, device=device)
    if "quant" in doc:  # written by seqlab.quant (int4 / int8 buffers, checked against their digest)
        return load_quantized(folder, doc).to(device=device)
    cfg = ModelConfig.from_dict(doc["config"])
    model = build_model(cfg)
    load_state_into(model, load_tensors(folder / "model.safetensors"), str(folder / "model.safetensors"))
    return model.to(device=device, dtype=dtype).eval()

