"""ModelConfig: every architecture knob of the one Transformer core, validated on construction.

One dataclass describes GPT-2, Llama, BERT, BART and the NNQS wavefunction alike; the differences between those
families are a handful of switches (where the norm sits, which MLP, how positions enter), not separate classes.
Validation happens in ``__post_init__`` so a bad config fails where it is written, with the field named, instead of
as a shape error deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURES = ("decoder", "encoder", "encoder_decoder")
POSITIONS = ("rope", "learned", "sinusoidal", "none")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the configuration (``owner``) and the field."""

    owner = "ModelConfig"

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{self.owner}.{field_name}: {message}")
        self.field = field_name


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def check_field_types(obj: Any) -> None:
    """Each dataclass field holds its annotated scalar type (``"2"`` for an int is refused, naming the field).

    JSON gives strings and bools where a hand-edited config.json goes wrong; catching that here turns a TypeError
    deep inside validation or the model into one line naming the field. Floats accept ints; ints refuse bools.
    """
    for f in dataclasses.fields(obj):
        kinds = [k.strip() for k in str(f.type).split("|")]
        if not all(k in _SCALARS or k == "None" for k in kinds):
            continue  # containers (extra) are free-form
        value = getattr(obj, f.name)
        if value is None and "None" in kinds:
            continue
        ok = any(
            isinstance(value, bool) if k == "bool"
            else (isinstance(value, (int, float)) and not isinstance(value, bool)) if k == "float"
            else (isinstance(value, int) and not isinstance(value, bool)) if k == "int"
            else isinstance(value, _SCALARS[k]) if k in _SCALARS else False
            for k in kinds)
        if not ok:
            raise ConfigError(f.name, f"expected {f.type}, got {type(value).__name__} {value!r}")


@dataclass
class ModelConfig:
    """Architecture of a seqlab Transformer.

    Defaults describe a small Llama-style decoder. ``d_ff`` defaults to 4*d_model for a GELU MLP and to the
    Llama rule (2/3 of 4*d_model rounded up to a multiple of 64) for SwiGLU so both have similar parameter counts.
    """

    arch: str = "decoder"
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 512
    # encoder_decoder only: decoder depth (defaults to n_layers, which is then the encoder depth)
    n_decoder_layers: int | None = None

    pos: str = "rope"
    rope_base: float = 10000.0
    pos_offset: int = 0  # learned positions start at this row (BART keeps 2 unused rows)

    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True
    final_norm: bool | None = None  # default: True for pre-norm, False for post-norm
    embed_norm: bool = False  # norm right after the embeddings (BERT, BART)
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (T5/BART option)

    # attention variants of the Llama family (Qwen2/Qwen3/Mistral/Gemma-style); defaults keep the plain Llama
    attn_head_dim: int | None = None  # per-head width when it is not d_model // n_heads (Qwen3 and Gemma set it)
    qkv_bias: bool | None = None  # biases on the q/k/v projections only (Qwen2); default: same as ``bias``
    qk_norm: bool = False  # RMSNorm over each query/key head before the rotation (Qwen3)
    # a sliding-window model's window (Mistral): attending to everything equals it only up to this many positions,
    # so longer sequences are refused
    attention_window: int | None = None

    mlp: str = "swiglu"
    activation: str | None = None  # default: silu for swiglu, gelu for gelu
    bias: bool = False  # biases in attention and MLP projections
    tie_embeddings: bool = True
    lm_head_bias: bool = False  # a bias on the output logits (BERT's decoder bias, BART's final_logits_bias)
    mlm_head_transform: bool = False  # BERT: dense + activation + norm before the output projection
    type_vocab_size: int = 0  # BERT token-type embeddings (row 0 is added when no token_type_ids are given)

    dropout: float = 0.0
    attn_dropout: float = 0.0
    init_std: float = 0.02

    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None

    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (e.g. source format); not used by the model

    def __post_init__(self) -> None:
        check_field_types(self)
        if not isinstance(self.extra, dict):  # (a string here failed in every later command that read it)
            raise ConfigError("extra", f"expected a JSON object (dict), got {type(self.extra).__name__} {self.extra!r}")
        quant = self.extra.get("quant")  # the layout seqlab.quant records: {"layers": {name: {"bits", ...}}, ...}
        if quant is not None and not (isinstance(quant, dict) and isinstance(quant.get("layers"), dict) and all(
                isinstance(spec, dict) and isinstance(spec.get("bits"), int) and isinstance(spec.get("group_size"), int)
                for spec in quant["layers"].values())):
            raise ConfigError("extra", "'quant' is not a quantised layout as seqlab.quant records it "
                                       "({'layers': {name: {'bits': int, 'group_size': int, ...}}})")
        if self.arch not in ARCHITECTURES:
            raise ConfigError("arch", f"unknown architecture {self.arch!r}; expected one of {ARCHITECTURES}")
        if self.pos not in POSITIONS:
            raise ConfigError("pos", f"unknown position kind {self.pos!r}; expected one of {POSITIONS}")
        if self.norm not in NORMS:
            raise ConfigError("norm", f"unknown norm {self.norm!r}; expected one of {NORMS}")
        if self.mlp not in MLPS:
            raise ConfigError("mlp", f"unknown MLP {self.mlp!r}; expected one of {MLPS}")
        if self.activation is None:
            self.activation = "silu" if self.mlp == "swiglu" else "gelu"
        if self.activation not in ACTIVATIONS:
            raise ConfigError("activation", f"unknown activation {self.activation!r}; expected one of {ACTIVATIONS}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0:
            raise ConfigError("n_kv_heads", f"must be a positive integer, got {self.n_kv_heads!r}")
        if self.attn_head_dim is not None and (not isinstance(self.attn_head_dim, int) or self.attn_head_dim <= 0):
            raise ConfigError("attn_head_dim", f"must be a positive integer or None, got {self.attn_head_dim!r}")
        if self.attention_window is not None and self.attention_window <= 0:
            raise ConfigError("attention_window", f"must be a positive integer or None, got {self.attention_window!r}")
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.attn_head_dim is None and self.d_model % self.n_heads:
            raise ConfigError("d_model", f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_heads", f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model if self.mlp == "gelu" else 64 * -(-(8 * self.d_model // 3) // 64)
        if self.d_ff <= 0:
            raise ConfigError("d_ff", f"must be a positive integer, got {self.d_ff!r}")
        if self.n_decoder_layers is None:
            self.n_decoder_layers = self.n_layers
        if self.n_decoder_layers <= 0:
            raise ConfigError("n_decoder_layers", f"must be a positive integer, got {self.n_decoder_layers!r}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError("pos", f"rope needs an even head_dim, got {self.head_dim}")
        if self.final_norm is None:
            self.final_norm = self.pre_norm
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {value!r}")
        if self.norm_eps <= 0:
            raise ConfigError("norm_eps", f"must be positive, got {self.norm_eps!r}")
        if not self.rope_base > 1:  # the rotation's wavelengths grow as powers of it; `not >` also refuses NaN
            raise ConfigError("rope_base", f"must be greater than 1, got {self.rope_base!r}")
        if self.pos_offset < 0:
            raise ConfigError("pos_offset", f"must be >= 0, got {self.pos_offset!r}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(name, f"{value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    # --- JSON round trip -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field(s) {unknown}")
        return cls(**data)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "ModelConfig":
        """Parse a JSON document, or read it from a path (a string that does not start with '{' is a path)."""
        is_text = isinstance(path_or_text, str) and path_or_text.lstrip().startswith("{")
        text = str(path_or_text) if is_text else Path(path_or_text).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path_or_text}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path_or_text}: expected a JSON object")
        return cls.from_dict(data)
