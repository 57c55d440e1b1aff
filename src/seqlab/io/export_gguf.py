"""Export seqlab Llama-family decoders as GGUF (llama.cpp's format) with the ``gguf`` package's ``GGUFWriter``.

The inverse of :mod:`seqlab.io.gguf`: seqlab -> HF names (:func:`seqlab.io.export_hf.to_hf`) -> GGUF names
(:mod:`seqlab.io.gguf_arch`). The architecture is the one the HF export would name (``llama``; ``qwen2`` when only
q/k/v have biases; ``qwen3`` with q/k norms), written with that architecture's metadata (sizes, head size, rope
base, norm epsilon) plus the tokenizer as byte-level BPE (``tokenizer.ggml.model = gpt2``, ``pre`` the split it
makes: tokens, types, merges, special ids, chat template). Only for ``llama`` are the Q/K rows permuted into
llama.cpp's interleaved-pair rotary order; qwen2/qwen3 keep HF's rotate-half rows, as llama.cpp's converter does.

Weights: ``f32``; ``f16``; ``q8_0``, ``q4_0``, ``q4_1`` through ``gguf.quants.quantize`` (llama.cpp's own block
formats). As llama.cpp does, 1-D tensors (norms, biases) stay f32, and a matrix whose rows do not fill whole
quantisation blocks is written f16 instead of failing.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from seqlab.io.export_hf import ExportError, llama_model_type, to_hf
from seqlab.io.gguf_arch import ARCHITECTURES, GGUFArch, gguf_name, rope_permutation
from seqlab.io.tokenizer import GGUF_PRE_TOKENIZERS, gguf_pre_name
from seqlab.runtime.files import atomic_path

__all__ = ["WEIGHT_TYPES", "check_exportable", "export_gguf", "gguf_architecture", "gguf_name", "rope_permutation",
           "tokenizer_metadata"]

WEIGHT_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}  # llama.cpp's LlamaFileType
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types


def _import_gguf():
    try:  # optional dependency: only GGUF export needs it
        import gguf
    except ImportError as e:
        raise ExportError("writing GGUF files needs the `gguf` package: pip install 'seqlab[gguf]'") from e
    return gguf


def gguf_architecture(cfg) -> GGUFArch:
    """The GGUF architecture for ``cfg`` (the HF export's model_type); ExportError naming a field llama.cpp lacks."""
    arch = ARCHITECTURES[llama_model_type(cfg, fam="GGUF (llama, qwen2, qwen3)")]
    if arch.name == "qwen3" and (cfg.qkv_bias or cfg.bias):
        field = "qkv_bias" if cfg.qkv_bias else "bias"
        raise ExportError(f"cannot export as GGUF qwen3: ModelConfig.{field}=True (llama.cpp's qwen3 has no biases)")
    return arch


def check_exportable(cfg) -> None:
    """Refuse, before any weights are read, a configuration no supported GGUF architecture expresses."""
    gguf_architecture(cfg)


def tokenizer_metadata(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """``tokenizer.ggml.*`` values for a byte-level BPE tokenizer (seqlab's BPE and byte tokenizers both are)."""
    backend = tokenizer.backend
    model = json.loads(backend.to_str())["model"]
    if model.get("type") != "BPE":
        raise ExportError(f"cannot export the tokenizer to GGUF: model type {model.get('type')!r} (need BPE)")
    n = backend.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ExportError(f"the tokenizer has {n} tokens but ModelConfig.vocab_size={vocab_size}")
    special = set(tokenizer.special_ids)
    tokens = [backend.id_to_token(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, vocab_size)]
    # an added token that is not special (a tool tag) is USER_DEFINED, which llama.cpp and seqlab's reader match
    # whole; as NORMAL it was one more BPE piece, never produced from text
    added = {i for i, t in backend.get_added_tokens_decoder().items() if not t.special}
    types = [_CONTROL if i in special else _USER_DEFINED if i in added else _NORMAL for i in range(n)]
    types += [_UNUSED] * (vocab_size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = gguf_pre_name(backend)
    if pre is None and merges:  # without merges every byte is its own token, however the text is split
        raise ExportError("cannot export the tokenizer to GGUF: its pre-tokenizer splits text like none of "
                          f"llama.cpp's that seqlab knows ({', '.join(sorted(GGUF_PRE_TOKENIZERS))}), so a GGUF "
                          "reader would tokenize differently; export to a Hugging Face folder instead")
    meta = {"tokens": tokens, "types": types, "merges": merges, "chat_template": tokenizer.chat_template,
            "pre": pre or "gpt-2"}
    meta.update(bos=tokenizer.bos_id, eos=tokenizer.eos_id, pad=tokenizer.pad_id, unk=tokenizer.unk_id)
    return meta


def _encode(gguf, values: np.ndarray, qtype_name: str):
    """(array to write, raw dtype or None) for one tensor."""
    if values.ndim == 1 or qtype_name == "f32":
        return values.astype(np.float32), None
    if qtype_name == "f16":
        return values.astype(np.float16), None
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name.upper())
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.shape[-1] % block:
        return values.astype(np.float16), None
    try:
        return gguf.quants.quantize(values.astype(np.float32), qtype), qtype
    except NotImplementedError as e:  # older `gguf` releases quantise fewer block types
        raise ExportError(f"--weights {qtype_name}: this `gguf` package cannot quantise it ({e}); upgrade gguf") from e


def export_gguf(model: nn.Module, out_path: str | os.PathLike, tokenizer: Any = None, weight_type: str = "f32",
                name: str = "seqlab") -> Path:
    """Write ``model`` (and ``tokenizer``) to ``out_path`` as a GGUF file, atomically (temp file, then rename)."""
    if weight_type not in WEIGHT_TYPES:
        raise ExportError(f"unknown GGUF weight type {weight_type!r}; expected one of {WEIGHT_TYPES}")
    gguf = _import_gguf()
    cfg = model.config
    arch = gguf_architecture(cfg)
    _, tensors = to_hf(model)
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight")  # no output.weight: llama.cpp (and seqlab's reader) tie to token_embd
    out = Path(out_path)
    kept_f16: list[str] = []
    with atomic_path(out) as tmp:
        writer = _writer(gguf, tmp, arch.name)
        _write_metadata(writer, cfg, arch, tokenizer, weight_type, name)
        for hf_name, t in tensors.items():
            values = _numpy(t)
            if ".q_proj." in hf_name:
                values = arch.qk_from_hf(values, cfg.n_heads)
            elif ".k_proj." in hf_name:
                values = arch.qk_from_hf(values, cfg.n_kv_heads)
            data, raw_dtype = _encode(gguf, values, weight_type)
            if raw_dtype is None and values.ndim > 1 and weight_type not in ("f32", "f16"):
                kept_f16.append(f"{gguf_name(hf_name)} ({values.shape[-1]} per row)")
            writer.add_tensor(gguf_name(hf_name), data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    if kept_f16:  # said, not silent: the file is larger and more exact than the type asked for
        block = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, weight_type.upper())][0]
        shown = ", ".join(kept_f16[:4]) + (f" and {len(kept_f16) - 4} more" if len(kept_f16) > 4 else "")
        warnings.warn(f"--weights {weight_type}: {len(kept_f16)} matri{'ces' if len(kept_f16) > 1 else 'x'} with "
                      f"rows that are not whole blocks of {block} written f16, as llama.cpp does: {shown}")
    return out


def _writer(gguf: Any, path: Path, arch_name: str):
    """gguf's writer, except that it also writes an empty typed array: a byte tokenizer has no merges, llama.cpp
    requires the merges key of a gpt2 vocabulary, and the format allows an empty array where the package refuses."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer(path, arch_name)


def _numpy(t: Tensor) -> np.ndarray:
    return t.detach().float().cpu().contiguous().numpy()


def _write_metadata(writer, cfg, arch: GGUFArch, tokenizer, weight_type: str, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPES[weight_type])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    if arch.name == "qwen3" or cfg.attn_head_dim is not None:  # as llama.cpp's converter does for HF's head_dim
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    if tokenizer is None:
        return
    meta = tokenizer_metadata(tokenizer, cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    gguf = _import_gguf()
    writer.add_key_value(gguf.Keys.Tokenizer.MERGES, meta["merges"], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.STRING)  # written even when empty (see _writer)
    for key, adder in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if meta[key] is not None:
            adder(meta[key])
    writer.add_add_bos_token(tokenizer.adds_bos)
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])
