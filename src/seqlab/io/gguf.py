"""Import GGUF files (llama.cpp's format) as seqlab models: weights, config, tokenizer and chat template.

    from seqlab.io import load_gguf
    model, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)

How it works, and why this way:

1. The file is opened and validated by :mod:`seqlab.io.gguf_file` (magic bytes, bounds-checked header, every
   tensor's byte range against the file size), so a truncated download is refused with a message, not a crash.
2. :mod:`seqlab.io.gguf_arch` turns the metadata (``llama.block_count`` ...) into a Hugging Face ``config.json``
   dict of the same family (``llama``, ``qwen2``, ``qwen3``) and tensor names (``blk.3.attn_q.weight``) into HF names
   (``model.layers.3.self_attn.q_proj.weight``). The HF importer (:func:`seqlab.io.hf.convert_hf_state_dict`) maps
   those onto seqlab: each family's mapping lives in one place.
3. Quantised blocks (Q4_1, Q8_0, ...) are dequantised to float32, then cast, unless ``quant="gguf"`` keeps them.
4. For the llama architecture, llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its
   interleaved-pair rotary kernel; we undo that, which puts the weights back in the rotate-half convention of
   seqlab's ``Rotary`` (and HF's). qwen2 / qwen3 files are stored in rotate-half order already.

Byte-level BPE (``gpt2``) vocabularies only; anything else raises :class:`GGUFError` naming what was found.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from seqlab.config import ModelConfig
from seqlab.io.gguf_arch import (SUPPORTED_ARCHITECTURES, architecture_of, gguf_hf_config, hf_name,
                                 reverse_rope_permutation)
from seqlab.io.gguf_file import GGUFError, GGUFFile, GGUFTensorInfo, read_gguf
from seqlab.io.hf import convert_hf_state_dict
from seqlab.io.tensors import load_state_into
from seqlab.io.tokenizer import tokenizer_from_gguf
from seqlab.model import build_model
from seqlab.quant.convert import cast_unquantised, quantize
from seqlab.quant.gguf_map import build_with_layers, map_gguf_layers, placeholder
from seqlab.runtime import progress

# int4 from a GGUF file keeps the file's own 32-wide Q4 blocks by default: re-gridding Q4 weights into wider groups
# costs real perplexity (docs/quantization.md)
GGUF_INT4_GROUP_SIZE = 32

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFTensorInfo",
    "SUPPORTED_ARCHITECTURES",
    "gguf_hf_config",
    "gguf_to_hf_state_dict",
    "load_gguf",
    "read_gguf",
    "reverse_rope_permutation",
]


def gguf_to_hf_state_dict(f: GGUFFile, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                          placeholders: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to ``dtype`` under its HF name, Q/K rows in rotate-half order
    (``placeholders``, kept quantised by the caller, become shape-only ``meta`` tensors)."""
    arch = architecture_of(f)
    names = {n: hf_name(n, arch) for n in f.tensors}
    unknown = sorted(n for n, hf in names.items() if hf is None)
    if unknown:
        raise GGUFError(f"{f.path}: unknown tensors for a {arch.name!r} GGUF: "
                        f"{unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    out: dict[str, torch.Tensor] = {}
    for name in progress(f.tensors, desc=f"loading {f.path.name}", unit="tensor", leave=False, delay=2.0):
        if name in placeholders:
            out[names[name]] = placeholder(f, name)
            continue
        values = f.dequantize(name)
        if not np.isfinite(values).all():  # corrupted data: refuse here, where the GGUF tensor name is known
            raise GGUFError(f"{f.path}: tensor {name!r} has {int((~np.isfinite(values)).sum())} non-finite values "
                            "(NaN/inf); the file is corrupted, refusing to load it")
        if ".attn_q." in name:
            values = arch.qk_to_hf(values, hf_config["num_attention_heads"])
        elif ".attn_k." in name:
            values = arch.qk_to_hf(values, hf_config["num_key_value_heads"])
        out[names[name]] = torch.from_numpy(np.require(values, np.float32, ["C", "W"])).to(dtype)
    return out


# ------------------------------------------------------------------------------------------------ loading
def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
              with_tokenizer: bool = True, quant: str | None = None):
    """Load a llama / qwen2 / qwen3 GGUF as ``(model, tokenizer)``: a seqlab decoder in eval mode and a
    :class:`seqlab.data.tokenizer.Tokenizer`.

    ``model.config.extra`` records the source file and the GGUF tensor types; the tokenizer carries the special
    ids and the chat template from the file. ``with_tokenizer=False`` returns ``(model, None)``.
    ``quant``: "gguf" keeps Q4_0/Q4_1/Q8_0 blocks quantised, "int8" re-quantises (groups of 32),
    "int4" too (groups of 32, the file's own Q4 block size), None is dense.
    """
    f = read_gguf(path)
    hf_config = gguf_hf_config(f)
    tokenizer = None
    if with_tokenizer:
        tokenizer = tokenizer_from_gguf(f.metadata, source=str(f.path))
    if quant not in (None, "gguf", "int8", "int4"):
        raise GGUFError(f"quant={quant!r} is not one of gguf, int8, int4 (or None for dense)")
    arch = architecture_of(f)
    layers, used = map_gguf_layers(f, hf_config, arch.qk_to_hf) if quant == "gguf" else ({}, set())
    requantise = quant in ("int8", "int4")  # they round the fp32 weights; the rest of the model takes dtype after
    tensors = gguf_to_hf_state_dict(f, hf_config, dtype=torch.float32 if requantise else dtype, placeholders=used)
    try:
        cfg, state = convert_hf_state_dict(hf_config, tensors)
    except ValueError as e:  # the HF mapping names fields and tensors; name the file too
        raise GGUFError(f"{f.path}: {e}") from None
    del tensors
    types = sorted({t.qtype.name for t in f.tensors.values()})
    cfg.extra = {**cfg.extra, "source": f"gguf:{f.architecture}", "file": str(f.path), "gguf_tensor_types": types,
                 "name": f.metadata.get("general.name")}
    _check_model_config(cfg, f)
    if quant == "gguf":
        return cast_unquantised(build_with_layers(cfg, state, layers, str(f.path)).to(device=device), dtype), tokenizer
    with torch.device("cpu"):
        model = build_model(cfg)
    model.to(torch.float32 if requantise else dtype)
    load_state_into(model, state, str(f.path))
    model = model.to(device=device).eval()
    if requantise:
        model = quantize(model, bits=int(quant[3:]), group_size=GGUF_INT4_GROUP_SIZE if quant == "int4" else None)
        cast_unquantised(model, dtype)
    return model, tokenizer


def _check_model_config(cfg: ModelConfig, f: GGUFFile) -> None:
    emb = f.tensors.get("token_embd.weight")
    if emb is not None and emb.shape[0] != cfg.vocab_size:
        raise GGUFError(f"{f.path}: token_embd has {emb.shape[0]} rows but the vocabulary has {cfg.vocab_size} tokens")
