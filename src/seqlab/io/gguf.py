"""Import GGUF files (llama.cpp's format) as seqlab models: weights, config, tokenizer and chat template.

    from seqlab.io import load_gguf
    model, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)

How it works, and why this way:

1. The file is opened with the ``gguf`` package's reader after checking the magic bytes, and every tensor's byte
   range is checked against the file size, so a truncated download is refused with a message instead of a numpy
   or mmap crash halfway through.
2. Metadata (``llama.block_count`` ...) becomes a Hugging Face style Llama ``config.json`` dict and tensor names
   (``blk.3.attn_q.weight``) become HF names (``model.layers.3.self_attn.q_proj.weight``). The lead's HF importer
   (:func:`seqlab.io.hf.convert_hf_state_dict`) maps those onto seqlab: the Llama mapping lives in one place.
3. Quantised blocks (Q4_1, Q8_0, ...) are dequantised to float32, then cast, unless ``quant="gguf"`` keeps them.
4. llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that its interleaved-pair ("NORM")
   rotary kernel gives the same result as HF's rotate-half rotary. We undo that permutation, which puts the
   weights back in the rotate-half convention that seqlab's ``Rotary`` (like HF Llama) uses.

Only the ``llama`` architecture with a byte-level BPE (``gpt2``) vocabulary is supported; anything else raises
:class:`GGUFError` naming what was found.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seqlab.config import ModelConfig
from seqlab.io.hf import convert_hf_state_dict
from seqlab.io.tensors import load_state_into
from seqlab.io.tokenizer import tokenizer_from_gguf
from seqlab.model import build_model
from seqlab.runtime import progress
from seqlab.quant import quantize
from seqlab.quant.gguf_map import build_with_layers, map_gguf_layers, placeholder

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

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


class GGUFError(ValueError):
    """The file is not a usable GGUF: malformed, truncated, or an architecture / tensor type we cannot load."""


def _import_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # the package is an optional extra
        raise GGUFError("reading GGUF files needs the `gguf` package: pip install 'seqlab[gguf]'") from e
    return gguf


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    """Where one tensor lives: ``shape`` in PyTorch order (slowest dim first), ``start``/``nbytes`` in the file."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    start: int
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; any overrun is a truncation error."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated or malformed GGUF: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.size}")

    def scalar(self, vtype: int, what: str):
        fmt = _SCALARS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 at offset {self.pos - n}") from e

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.scalar(4, what)
            count = self.scalar(10, what)
            if itype in _NUMPY_SCALARS:  # numeric arrays in one read (token types, scores)
                dt = np.dtype(_NUMPY_SCALARS[itype])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return [bool(x) for x in arr] if itype == 7 else arr.tolist()
            if count > self.size - self.pos:  # each item takes at least one byte: refuse absurd counts early
                raise GGUFError(f"{self.path}: malformed GGUF: {what} claims {count} items at offset {self.pos}")
            return [self.value(itype, f"{what}[{i}]") for i in range(count)]
        raise GGUFError(f"{self.path}: malformed GGUF: {what} has unknown value type {vtype} at offset {self.pos - 4}")


class GGUFFile:
    """A validated, memory-mapped GGUF file: ``metadata`` (plain Python values) and ``tensors`` (infos by name).

    The header is parsed here rather than with ``gguf.GGUFReader`` because that reader builds a numpy view per
    string and takes 5-20 s on a 49k-token vocabulary; this parser takes well under a second. Every read is bounds
    checked, so a truncated or corrupted file raises :class:`GGUFError` naming the offset, never a crash. Tensor
    payloads stay in the mmap until :meth:`dequantize` reads one.
    """

    def __init__(self, path: str | os.PathLike):
        gguf = _import_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        with open(self.path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < 24:
                raise GGUFError(f"{self.path}: truncated GGUF: {os.fstat(fh.fileno()).st_size} bytes is shorter than the header")
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._mm, self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.scalar(4, "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (supported: 2, 3)")
        n_tensors = cur.scalar(10, "tensor_count")
        n_kv = cur.scalar(10, "kv_count")
        if n_tensors > cur.size or n_kv > cur.size:
            raise GGUFError(f"{self.path}: malformed GGUF header: tensor_count={n_tensors}, kv_count={n_kv}")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar(4, f"type of {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.scalar(4, f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{self.path}: malformed GGUF: tensor {name!r} has {n_dims} dimensions")
            dims = [cur.scalar(10, f"tensor {name!r} dims") for _ in range(n_dims)]
            type_id = cur.scalar(4, f"tensor {name!r} type")
            offset = cur.scalar(10, f"tensor {name!r} offset")
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown GGML type id {type_id}") from None
            infos.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment={align} is not a power of two")
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, qtype, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            if dims[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of the "
                                f"{qtype.name} block size {block}")
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > cur.size:
                raise GGUFError(f"{self.path}: truncated GGUF: tensor {name!r} needs bytes up to {start + nbytes} "
                                f"but the file has {cur.size}")
            if name in self.tensors:
                raise GGUFError(f"{self.path}: malformed GGUF: tensor {name!r} appears twice")
            self.tensors[name] = GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, start, nbytes)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata key 'general.architecture' is missing")
        return arch

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy, in PyTorch layout (``[out_features, in_features]`` for matrices)."""
        gguf = _import_gguf()
        t = self.tensors[name]
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.start)
        raw = raw.reshape(*t.shape[:-1], t.nbytes // max(1, int(np.prod(t.shape[:-1]))))
        try:
            values = gguf.quants.dequantize(raw, t.qtype)
        except NotImplementedError as e:
            raise GGUFError(f"{self.path}: tensor {name!r} has type {t.qtype.name}, which cannot be dequantised ({e})") from e
        return np.asarray(values, dtype=np.float32).reshape(t.shape)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file (header, metadata and tensor byte ranges); tensors are not read yet."""
    return GGUFFile(path)


# ------------------------------------------------------------------------------------------------ config
def _check_architecture(f: GGUFFile) -> str:
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{f.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def gguf_hf_config(f: GGUFFile) -> dict[str, Any]:
    """GGUF metadata -> the equivalent Hugging Face Llama ``config.json`` dict."""
    arch = _check_architecture(f)
    m = f.metadata
    key = lambda k: f"{arch}.{k}"  # noqa: E731
    if m.get(key("expert_count"), 0):
        raise GGUFError(f"{f.path}: mixture-of-experts Llama ({m[key('expert_count')]} experts) is not supported")
    scaling = m.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{f.path}: rope scaling {scaling!r} ({key('rope.scaling.type')}) is not supported")
    if "rope_freqs.weight" in f.tensors:
        raise GGUFError(f"{f.path}: tensor 'rope_freqs.weight' (Llama-3.1 rope scaling) is not supported")
    def scalar(name: str, default: Any = None) -> Any:
        value = f.require(key(name)) if default is None else m.get(key(name), default)
        if isinstance(value, list):  # per-layer arrays (some hybrid models) are only fine when uniform
            if not value or len(set(value)) != 1:
                raise GGUFError(f"{f.path}: per-layer {key(name)}={value[:8]} is not supported")
            value = value[0]
        return value

    d_model = int(scalar("embedding_length"))
    n_heads = int(scalar("attention.head_count"))
    n_kv = int(scalar("attention.head_count_kv", n_heads))
    head_dim = d_model // n_heads
    rope_dim = int(m.get(key("rope.dimension_count"), head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{f.path}: partial rotary ({key('rope.dimension_count')}={rope_dim}, head_dim={head_dim}) is not supported")
    vocab = m.get(key("vocab_size")) or len(m.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        vocab = int(f.tensors["token_embd.weight"].shape[0]) if "token_embd.weight" in f.tensors else 0
    ids = {k: m.get(f"tokenizer.ggml.{g}") for k, g in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                                         ("pad_token_id", "padding_token_id"))}
    return {
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": d_model,
        "num_hidden_layers": int(scalar("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "intermediate_size": int(scalar("feed_forward_length")),
        "max_position_embeddings": int(m.get(key("context_length"), 2048)),
        "rope_theta": float(m.get(key("rope.freq_base"), 10000.0)),
        "rms_norm_eps": float(m.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        **{k: (int(v) if v is not None else None) for k, v in ids.items()},
    }


# ------------------------------------------------------------------------------------------------ weights
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def reverse_rope_permutation(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved-pair rotary -> rotate-half rotary).

    llama.cpp stores, within each head, row ``2*i + j`` for HF row ``j*half + i`` (i < half, j in {0, 1}), so that
    its rotary kernel, which rotates adjacent pairs, sees the pairs HF's rotate-half forms from the two halves.
    Works for weights ``[n_heads*head_dim, d]`` and biases ``[n_heads*head_dim]``.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_state_dict(f: GGUFFile, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32,
                          placeholders: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to ``dtype`` under its HF Llama name, Q/K rows back in rotate-half order
    (``placeholders``, kept quantised by the caller, become shape-only ``meta`` tensors)."""
    unknown = sorted(n for n in f.tensors if _hf_name(n) is None)
    if unknown:
        raise GGUFError(f"{f.path}: unknown tensors for a Llama GGUF: {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    out: dict[str, torch.Tensor] = {}
    for name in progress(f.tensors, desc=f"loading {f.path.name}", unit="tensor", leave=False, delay=2.0):
        if name in placeholders:
            out[_hf_name(name)] = placeholder(f, name)
            continue
        values = f.dequantize(name)
        if not np.isfinite(values).all():  # corrupted data: refuse here, where the GGUF tensor name is known
            raise GGUFError(f"{f.path}: tensor {name!r} has {int((~np.isfinite(values)).sum())} non-finite values "
                            "(NaN/inf); the file is corrupted, refusing to load it")
        if ".attn_q." in name:
            values = reverse_rope_permutation(values, hf_config["num_attention_heads"])
        elif ".attn_k." in name:
            values = reverse_rope_permutation(values, hf_config["num_key_value_heads"])
        out[_hf_name(name)] = torch.from_numpy(np.require(values, np.float32, ["C", "W"])).to(dtype)
    return out


# ------------------------------------------------------------------------------------------------ loading
def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
              with_tokenizer: bool = True, quant: str | None = None):
    """Load a Llama GGUF as ``(model, tokenizer)``: a seqlab decoder in eval mode and a :class:`seqlab.data.tokenizer.Tokenizer`.

    ``model.config.extra`` records the source file and the GGUF tensor types; the tokenizer carries the special
    ids and the chat template from the file. ``with_tokenizer=False`` returns ``(model, None)``.
    ``quant``: "gguf" keeps Q4_0/Q4_1/Q8_0 blocks quantised, "int8"/"int4" (g64) re-quantise, None is dense.
    """
    f = read_gguf(path)
    hf_config = gguf_hf_config(f)
    tokenizer = None
    if with_tokenizer:
        tokenizer = tokenizer_from_gguf(f.metadata, source=str(f.path))
    if quant not in (None, "gguf", "int8", "int4"):
        raise GGUFError(f"quant={quant!r} is not one of gguf, int8, int4 (or None for dense)")
    layers, used = map_gguf_layers(f, hf_config, reverse_rope_permutation) if quant == "gguf" else ({}, set())
    tensors = gguf_to_hf_state_dict(f, hf_config, dtype=dtype, placeholders=used)
    cfg, state = convert_hf_state_dict(hf_config, tensors)
    del tensors
    types = sorted({t.qtype.name for t in f.tensors.values()})
    cfg.extra = {**cfg.extra, "source": f"gguf:{f.architecture}", "file": str(f.path), "gguf_tensor_types": types,
                 "name": f.metadata.get("general.name")}
    _check_model_config(cfg, f)
    if quant == "gguf":
        return build_with_layers(cfg, state, layers, str(f.path)).to(device=device), tokenizer
    with torch.device("cpu"):
        model = build_model(cfg)
    model.to(dtype)
    load_state_into(model, state, str(f.path))
    model = model.to(device=device).eval()
    if quant in ("int8", "int4"):
        model = quantize(model, bits=int(quant[3:]))
    return model, tokenizer


def _check_model_config(cfg: ModelConfig, f: GGUFFile) -> None:
    emb = f.tensors.get("token_embd.weight")
    if emb is not None and emb.shape[0] != cfg.vocab_size:
        raise GGUFError(f"{f.path}: token_embd has {emb.shape[0]} rows but the vocabulary has {cfg.vocab_size} tokens")
