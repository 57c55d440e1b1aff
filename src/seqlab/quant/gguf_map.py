"""GGUF quantised blocks mapped straight onto seqlab's int layouts: Q4_0/Q4_1 -> int4 g32, Q8_0 -> int8 g32.

Why no fp32 detour: a Q4_1 block is ``(d, m, 16 bytes of nibbles)`` with ``w = d * q + m``; that *is* an
asymmetric int4 group of 32 in llama.cpp's nibble order, which our kernel reads as it is. Q4_0 is
``w = (q - 8) * d`` = ``q * d + (-8 d)`` (exact in fp32), Q8_0 is ``w = q * d``. The block bytes are sliced into
``qweight`` / ``scales`` / ``mins``, the rows of ``attn_q`` / ``attn_k`` are permuted like the dense path, and
:func:`seqlab.quant.schemes.dequantize_weight` of the result equals the ``gguf`` package's dequantisation bit for
bit. The caller (``seqlab.io.gguf``) passes its name mapping and row permutation in, so this module reads the
file's bytes by offset and needs nothing from ``io``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np
import torch

from seqlab.model import build_model
from seqlab.quant.convert import build_meta, materialize, record_layout, tied_aliases
from seqlab.quant.linear import QuantEmbedding, QuantLinear
from seqlab.quant.schemes import Scheme

MAPPABLE = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}  # bits, bytes per block of 32
# GGUF block tensor -> (seqlab layer, position in its row concatenation); the Llama layout of io.hf.llama_weights
_TARGETS = {"attn_q": ("attn.qkv", 0), "attn_k": ("attn.qkv", 1), "attn_v": ("attn.qkv", 2),
            "attn_output": ("attn.out", 0), "ffn_gate": ("mlp.up", 0), "ffn_up": ("mlp.up", 1),
            "ffn_down": ("mlp.down", 0)}


def _target(name: str, tied: bool) -> tuple[str, int] | None:
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "lm_head.proj", 0
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _TARGETS:
        layer, pos = _TARGETS[parts[2]]
        return f"stack.blocks.{parts[1]}.{layer}", pos
    return None


def blocks_to_parts(raw: np.ndarray, qtype: str, rows: int) -> dict[str, torch.Tensor]:
    """Raw block bytes of a ``[rows, K]`` tensor -> ``qweight``, ``scales`` (fp32) [, ``mins``]."""
    bits, size = MAPPABLE[qtype]
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, size)
    d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        q = np.ascontiguousarray(b[:, :, 2:]).view(np.int8).reshape(rows, -1)
        return {"qweight": torch.from_numpy(q.copy()), "scales": torch.from_numpy(d)}
    if qtype == "Q4_1":
        m = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        q = b[:, :, 4:]
    else:  # Q4_0
        m = (np.float32(-8.0) * d).astype(np.float32)
        q = b[:, :, 2:]
    return {"qweight": torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)), "scales": torch.from_numpy(d),
            "mins": torch.from_numpy(np.ascontiguousarray(m))}


def _read(f: Any, info: Any) -> np.ndarray:
    return np.memmap(f.path, dtype=np.uint8, mode="r", offset=info.start, shape=(info.nbytes,))


def map_gguf_layers(f: Any, hf_config: dict, permute: Callable[[np.ndarray, int], np.ndarray]
                    ) -> tuple[dict[str, QuantLinear], set[str]]:
    """``{seqlab layer path: QuantLinear}`` for every linear whose GGUF parts all share one mappable type.

    Returns the layers and the GGUF tensor names they consumed. Linears in other types (or mixing types inside
    one concatenated layer) are left to the dense path, and a warning names them and their types.
    """
    tied = "output.weight" not in f.tensors
    groups: dict[str, dict[int, str]] = {}
    for name in f.tensors:
        t = _target(name, tied)
        if t is not None:
            groups.setdefault(t[0], {})[t[1]] = name
    layers, used, unmapped = {}, set(), []
    for path, members in groups.items():
        names = [members[i] for i in sorted(members)]
        types = {f.tensors[n].qtype.name for n in names}
        if len(types) != 1 or next(iter(types)) not in MAPPABLE:
            unmapped += [f"{n} ({f.tensors[n].qtype.name})" for n in names]
            continue
        qtype = types.pop()
        parts = []
        for n in names:
            info = f.tensors[n]
            p = blocks_to_parts(_read(f, info), qtype, info.shape[0])
            bad = int((~(torch.isfinite(p["scales"]) & torch.isfinite(p.get("mins", p["scales"])))).sum())
            if bad:  # as the dense path refuses non-finite values (io.gguf), here in the block scales it keeps
                raise ValueError(f"{f.path}: tensor {n!r} has {bad} blocks with a non-finite scale (NaN/inf); the "
                                 "file is corrupted, refusing to load it")
            heads = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(n.split(".")[-2])
            if heads:
                p = {k: torch.from_numpy(np.ascontiguousarray(permute(v.numpy(), hf_config[heads])))
                     for k, v in p.items()}
            parts.append(p)
        cat = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
        layers[path] = QuantLinear.from_parts(cat, Scheme(MAPPABLE[qtype][0], 32), None, path)
        used.update(names)
    if unmapped:
        warnings.warn(f"{f.path}: kept dense (dequantised to fp32), no int layout for: {', '.join(sorted(unmapped))}",
                      UserWarning, stacklevel=2)
    return layers, used


def placeholder(f: Any, name: str) -> torch.Tensor:
    """A shape-only stand-in for a consumed tensor, so the HF name mapping can run without its values."""
    return torch.empty(f.tensors[name].shape, device="meta")


def build_with_layers(cfg, state: dict[str, torch.Tensor], layers: dict[str, QuantLinear], source: str):
    """A model built without allocating the mapped linears' fp32 weights: built on ``meta``, quantised layers
    put in, the rest materialised and loaded (strictly) from ``state``."""
    model = build_meta(build_model, cfg)
    tied = {}
    for path, q in layers.items():
        old = model.get_submodule(path)
        if (old.in_features, old.out_features) != (q.in_features, q.out_features):
            raise ValueError(f"{source}: {path} is {q.in_features} -> {q.out_features} in the file, the model "
                             f"expects {old.in_features} -> {old.out_features}")
        embeds = [n for n, m in model.named_modules(remove_duplicate=False)
                  if isinstance(m, torch.nn.Embedding) and m.weight is old.weight]
        bias = state.get(f"{path}.bias")
        if bias is not None:
            q.bias = bias.float().contiguous()
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
        for e in embeds:
            p, _, c = e.rpartition(".")
            setattr(model.get_submodule(p) if p else model, c, QuantEmbedding(q))
        if embeds:
            tied[path] = embeds
    quant_keys = {f"{p}.{k}" for p in [*layers, *(e for es in tied.values() for e in es)] for k in ("weight", "bias")}
    rest = {k: v for k, v in state.items() if k not in quant_keys}
    if any(v.is_meta for v in rest.values()):
        raise ValueError(f"{source}: internal: values missing for {[k for k, v in rest.items() if v.is_meta]}")
    materialize(model)
    expected = {k for k in model.state_dict() if not any(k.startswith(p + ".") for p in layers)}
    missing, unexpected = sorted(expected - set(rest) - tied_aliases(model)), sorted(set(rest) - expected)
    if missing or unexpected:
        raise ValueError(f"{source}: tensors do not match the model: missing={missing} unexpected={unexpected}")
    model.load_state_dict(rest, strict=False)
    record_layout(model, {p: {"bits": q.bits, "group_size": q.group_size, "bias": q.bias is not None}
                          for p, q in layers.items()}, tied)
    return model.eval()
