"""The GGUF architectures seqlab reads and writes (``llama``, ``qwen2``, ``qwen3``): metadata, tensor names, Q/K rows.

All three are the decoder :func:`seqlab.io.hf.llama_config` already maps onto seqlab (RoPE, RMSNorm, SwiGLU, GQA),
so a GGUF file is translated into the Hugging Face config and tensor names of the same family and handed to the HF
importer; the families differ only in knobs:

- ``qwen2``: q/k/v carry biases (o_proj and the MLP do not);
- ``qwen3``: an explicit head size (``qwen3.attention.key_length``) and RMSNorm on q and k per head
  (``blk.N.attn_q_norm`` / ``attn_k_norm``);
- ``llama``: may also have an explicit head size (``llama.attention.key_length``).

Rotary row order: llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for the llama architecture
only, because its llama graph uses the interleaved-pair ("normal") rotary; qwen2 and qwen3 run the "neox" rotary,
which is HF's rotate-half, so their rows are stored as HF has them. ``GGUFArch.permuted_qk`` records which.
Sliding-window attention (a ``*.attention.sliding_window`` shorter than the context) is refused: seqlab attends to
the whole context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from seqlab.io.gguf_file import GGUFError, GGUFFile

__all__ = ["ARCHITECTURES", "GGUFArch", "SUPPORTED_ARCHITECTURES", "architecture_of", "gguf_hf_config", "gguf_name",
           "hf_name", "reverse_rope_permutation", "rope_permutation"]

# GGUF block tensor -> HF module inside ``model.layers.N`` (llama.cpp's names, gguf.constants.TENSOR_NAMES)
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_BLOCK_NAMES = {hf: g for g, hf in BLOCK_NAMES.items()}
_HF_GLOBAL_NAMES = {hf: g for g, hf in GLOBAL_NAMES.items()}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_DENSE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF architecture: its ``general.architecture`` name, block tensors, and the Q/K row order it stores."""

    name: str
    block_tensors: tuple[str, ...]
    permuted_qk: bool  # attn_q / attn_k rows in llama.cpp's interleaved-pair order (llama only)

    def qk_to_hf(self, w: np.ndarray, n_heads: int) -> np.ndarray:
        """Stored ``attn_q`` / ``attn_k`` rows (or bias) -> HF's rotate-half order."""
        return reverse_rope_permutation(w, n_heads) if self.permuted_qk else w

    def qk_from_hf(self, w: np.ndarray, n_heads: int) -> np.ndarray:
        """HF's rotate-half rows -> the order this architecture stores."""
        return rope_permutation(w, n_heads) if self.permuted_qk else w


ARCHITECTURES = {
    "llama": GGUFArch("llama", _DENSE, permuted_qk=True),
    "qwen2": GGUFArch("qwen2", _DENSE, permuted_qk=False),
    "qwen3": GGUFArch("qwen3", _DENSE + ("attn_q_norm", "attn_k_norm"), permuted_qk=False),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


# ------------------------------------------------------------------------------------------------ names
def hf_name(name: str, arch: GGUFArch) -> str | None:
    """GGUF tensor name -> HF name, or None when ``arch`` has no such tensor."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in arch.block_tensors:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def gguf_name(hf: str) -> str:
    """HF Llama-family tensor name -> GGUF name (the inverse of :func:`hf_name`)."""
    if hf in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_BLOCK_NAMES[module]}.{kind}"


# ------------------------------------------------------------------------------------------------ rotary rows
def rope_permutation(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` of Q/K rows (rotate-half -> interleaved pairs), for the llama architecture.

    Within each head, HF row ``j*half + i`` is stored at row ``2*i + j`` (i < half, j in {0, 1}), so that llama.cpp's
    rotary kernel, which rotates adjacent pairs, sees the pairs HF's rotate-half forms from the two halves.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reverse_rope_permutation(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo :func:`rope_permutation`; works for weights ``[n_heads*head_dim, d]`` and biases ``[n_heads*head_dim]``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------------------------ metadata
def architecture_of(f: GGUFFile) -> GGUFArch:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return ARCHITECTURES[arch]


def _sliding_window(m: dict, key) -> int | None:
    """The file's sliding window (the widest, where it lists one per layer), or None."""
    window = m.get(key("attention.sliding_window"))
    window = max(window) if isinstance(window, list) and window else window
    return int(window) if window else None


def _check_unsupported(f: GGUFFile, key) -> None:
    m = f.metadata
    if m.get(key("expert_count"), 0):
        experts = f"{key('expert_count')}={m[key('expert_count')]}"
        raise GGUFError(f"{f.path}: mixture-of-experts ({experts}) is not supported")
    scaling = m.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{f.path}: rope scaling {scaling!r} ({key('rope.scaling.type')}) is not supported")
    if "rope_freqs.weight" in f.tensors:
        raise GGUFError(f"{f.path}: tensor 'rope_freqs.weight' (Llama-3.1 rope scaling) is not supported")
    window = _sliding_window(m, key)
    context = int(m.get(key("context_length"), 2048))
    if window is not None and window < context:
        raise GGUFError(f"{f.path}: sliding-window attention ({key('attention.sliding_window')}={window} < "
                        f"{key('context_length')}={context}) is not supported: seqlab attends to the full context")


def gguf_hf_config(f: GGUFFile) -> dict[str, Any]:
    """GGUF metadata -> the equivalent Hugging Face ``config.json`` dict (``model_type`` = the GGUF architecture)."""
    arch = architecture_of(f)
    m = f.metadata
    key = lambda k: f"{arch.name}.{k}"  # noqa: E731
    _check_unsupported(f, key)

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
    for name, value in (("embedding_length", d_model), ("attention.head_count", n_heads),
                        ("attention.head_count_kv", n_kv)):
        if value < 1:
            raise GGUFError(f"{f.path}: {key(name)}={value} must be at least 1")
    head_dim = int(scalar("attention.key_length", d_model // n_heads))
    value_dim = int(scalar("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{f.path}: {key('attention.value_length')}={value_dim} differs from "
                        f"{key('attention.key_length')}={head_dim}; seqlab needs one head size")
    rope_dim = int(m.get(key("rope.dimension_count"), head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{f.path}: partial rotary ({key('rope.dimension_count')}={rope_dim}, head_dim={head_dim}) "
                        "is not supported")
    vocab = m.get(key("vocab_size")) or len(m.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        vocab = int(f.tensors["token_embd.weight"].shape[0]) if "token_embd.weight" in f.tensors else 0
    window = _sliding_window(m, key)
    ids = {k: m.get(f"tokenizer.ggml.{g}") for k, g in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                                         ("pad_token_id", "padding_token_id"))}
    return {
        "model_type": arch.name,
        "vocab_size": int(vocab),
        "hidden_size": d_model,
        "num_hidden_layers": int(scalar("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": int(scalar("feed_forward_length")),
        "max_position_embeddings": int(m.get(key("context_length"), 2048)),
        "rope_theta": float(m.get(key("rope.freq_base"), 10000.0)),
        "rms_norm_eps": float(m.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in f.tensors,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        # a window as long as the context (a binding one was refused above) still limits the sequence length
        "sliding_window": window, "use_sliding_window": window is not None,
        **{k: (int(v) if v is not None else None) for k, v in ids.items()},
    }
