"""Quantised checkpoints: ``config.json`` + ``model.safetensors`` holding the int buffers as they are.

Why a digest: a quantised tensor has no redundancy to notice damage by, and a flipped byte in ``qweight`` is a
silently wrong model. ``config.json`` records the SHA-256 of ``model.safetensors`` and the layout (which layer has
which scheme); loading refuses a file whose digest, tensor names, shapes or dtypes do not match.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import nn

import seqlab
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.quant.convert import apply_layout, build_meta, materialize
from seqlab.runtime import CheckpointError, atomic_write_bytes, atomic_write_text

FORMAT = "seqlab"


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel():
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().contiguous().cpu()
    return out


def save_quantized(model: nn.Module, out_dir: str | Path) -> Path:
    """Write a quantised model (see :func:`seqlab.quant.quantize`) to ``out_dir``; returns the folder."""
    layout = model.config.extra.get("quant")
    if not layout:
        raise ValueError("the model is not quantised (seqlab.quant.quantize records the layout it applied)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = save_safetensors_bytes(_unique_state(model), metadata={"format": "pt"})
    atomic_write_bytes(out / "model.safetensors", data)
    doc = {"format": FORMAT, "seqlab_version": seqlab.__version__, "config": model.config.to_dict(),
           "quant": {"layout": layout, "sha256": hashlib.sha256(data).hexdigest()}}
    atomic_write_text(out / "config.json", json.dumps(doc, indent=2) + "\n")
    return out


def load_quantized(folder: str | Path, doc: dict) -> nn.Module:
    """Rebuild the model of ``doc`` (a parsed ``config.json`` with a ``quant`` section) and load its tensors."""
    folder = Path(folder)
    path = folder / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    data = path.read_bytes()
    quant = doc.get("quant")
    if not isinstance(quant, dict) or not isinstance(quant.get("layout"), dict) or "sha256" not in quant:
        raise CheckpointError(f"{folder / 'config.json'}: field 'quant' must hold 'layout' and 'sha256'")
    digest = hashlib.sha256(data).hexdigest()
    if digest != quant["sha256"]:
        raise CheckpointError(f"{path}: SHA-256 {digest[:16]}... does not match config.json's "
                              f"{str(quant['sha256'])[:16]}...: the quantised weights were truncated or altered")
    try:
        tensors = load_safetensors_bytes(data)
        cfg = ModelConfig.from_dict(doc["config"])
        model = apply_layout(build_meta(build_model, cfg), quant["layout"])
    except (SafetensorError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}: not a loadable quantised checkpoint: {e}") from e
    expected = model.state_dict()
    wrong = sorted(f"{k}: file {tensors[k].dtype}{tuple(tensors[k].shape)} vs model {v.dtype}{tuple(v.shape)}"
                   for k, v in expected.items() if k in tensors and (tensors[k].dtype != v.dtype
                                                                    or tensors[k].shape != v.shape))
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if wrong or missing or unexpected:
        raise CheckpointError(f"{path}: tensors do not match the quantised layout: missing={missing} "
                              f"unexpected={unexpected} mismatched={wrong}")
    materialize(model)
    model.load_state_dict(tensors, strict=True)
    return model.eval()
