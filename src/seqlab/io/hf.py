"""Hugging Face interop: import GPT-2, Llama (incl. GQA; Mistral, Qwen2, Qwen3), BERT and BART checkpoints into seqlab.

Each family is two small functions: ``*_config`` maps the HF ``config.json`` onto a ModelConfig, and
``*_weights`` renames (and, where seqlab fuses projections, concatenates) tensors. Every HF tensor must be consumed
or explicitly ignorable, and every seqlab tensor must be produced: anything else is an error that lists the names,
because a silently half-loaded model is the worst failure an importer can have.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from seqlab.config import ModelConfig
from seqlab.io.hf_fields import (activation_name, eos_list, int_or_none, sliding_window, vocab_ids,
                                 with_generation_ids)
from seqlab.io.gguf_file import refuse_gguf_file
from seqlab.io.tensors import load_state_into, load_tensors, read_config_json
from seqlab.runtime import CheckpointError
from seqlab.model import build_model


def _meta_cat(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)`` for ``meta`` tensors without torch's meta kernel: that one is Python and imports
    ``torch._dynamo`` (and sympy) on first use, about 65 MiB of RSS a GGUF load with ``quant="gguf"`` paid."""
    rest = {tuple(t.shape[1:]) for t in parts}
    if len(rest) != 1 or len({t.dtype for t in parts}) != 1:
        raise CheckpointError(f"cannot concatenate tensors of shapes {[tuple(t.shape) for t in parts]}")
    return torch.empty((sum(t.shape[0] for t in parts), *rest.pop()), dtype=parts[0].dtype, device="meta")


class _Tensors:
    """HF tensors to be consumed by name; remembers which were used."""

    def __init__(self, tensors: dict[str, Tensor], prefix: str = ""):
        self.t = tensors
        self.prefix = prefix
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.t

    def take(self, name: str) -> Tensor:
        key = self.prefix + name
        if key not in self.t:
            raise CheckpointError(f"missing tensor {key!r} in the Hugging Face checkpoint")
        self.used.add(key)
        return self.t[key]

    def cat(self, *names: str) -> Tensor:
        parts = [self.take(n) for n in names]
        if all(t.is_meta for t in parts):  # shape-only stand-ins (layers kept quantised): the shape is all we need
            return _meta_cat(parts)
        return torch.cat(parts, dim=0)

    def leftover(self, ignore: Callable[[str], bool]) -> list[str]:
        return sorted(k for k in self.t if k not in self.used and not ignore(k))


def _linear(out: dict, dst: str, src: _Tensors, name: str, bias: bool, transpose: bool = False) -> None:
    w = src.take(f"{name}.weight")
    out[f"{dst}.weight"] = w.t().contiguous() if transpose else w
    if bias:
        out[f"{dst}.bias"] = src.take(f"{name}.bias")


def _norm(out: dict, dst: str, src: _Tensors, name: str, bias: bool = True) -> None:
    out[f"{dst}.weight"] = src.take(f"{name}.weight")
    if bias:
        out[f"{dst}.bias"] = src.take(f"{name}.bias")


# ---------------------------------------------------------------------------------------------------- GPT-2
def _take_tied(src: _Tensors, name: str, table: Tensor, what: str) -> None:
    """Consume ``name``, a copy of ``table`` in a tied checkpoint; refuse one that differs: seqlab's model keeps one
    table there, and silently keeping only ``what`` would compute something else."""
    if src.has(name):
        if not torch.equal(src.take(name), table):
            raise CheckpointError(f"{src.prefix}{name} differs from {what} (untied weights): this architecture "
                                  f"shares one token table in seqlab, so it cannot be loaded")


def gpt2_config(hf: dict) -> ModelConfig:
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
           "silu": "silu", "swish": "silu"}
    for key, plain in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
        if bool(hf.get(key, plain)) != plain:  # both change the attention scores; seqlab scales by 1/sqrt(d) only
            raise CheckpointError(f"GPT-2 {key}={hf[key]!r} is not supported (attention scaled by 1/sqrt(head_dim) "
                                  f"only)")
    return ModelConfig(
        arch="decoder", vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_layers=hf["n_layer"],
        n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * hf["n_embd"], max_seq_len=hf["n_positions"],
        pos="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), pre_norm=True, mlp="gelu",
        activation=activation_name(act, hf.get("activation_function", "gelu_new"), "GPT-2"), bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"),
        extra={"source": "hf:gpt2"},
    )


def gpt2_weights(src: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    if src.has("transformer.wte.weight"):
        src.prefix = "transformer."
    out = {"stack.embed.tok.weight": src.take("wte.weight"), "stack.embed.pos.weight": src.take("wpe.weight")}
    for i in range(cfg.n_layers):
        b, h = f"stack.blocks.{i}", f"h.{i}"
        _norm(out, f"{b}.attn_norm", src, f"{h}.ln_1")
        _linear(out, f"{b}.attn.qkv", src, f"{h}.attn.c_attn", True, transpose=True)  # GPT-2 Conv1D is x @ W
        _linear(out, f"{b}.attn.out", src, f"{h}.attn.c_proj", True, transpose=True)
        _norm(out, f"{b}.mlp_norm", src, f"{h}.ln_2")
        _linear(out, f"{b}.mlp.up", src, f"{h}.mlp.c_fc", True, transpose=True)
        _linear(out, f"{b}.mlp.down", src, f"{h}.mlp.c_proj", True, transpose=True)
    _norm(out, "stack.norm", src, "ln_f")
    src.prefix = ""
    _lm_head(out, src, cfg, "lm_head.weight")
    return out


def _lm_head(out: dict, src: _Tensors, cfg: ModelConfig, name: str) -> None:
    if cfg.tie_embeddings:
        if src.has(name):
            src.take(name)  # a tied copy; seqlab shares the token table
    else:
        out["lm_head.proj.weight"] = src.take(name)


# ---------------------------------------------------------------------------------------------------- Llama
def llama_config(hf: dict) -> ModelConfig:
    """Llama and the families that are Llama plus a knob: Qwen2 (q/k/v bias), Qwen3 (explicit head_dim, q/k
    RMSNorm), Mistral (sliding window: accepted only when it never binds, refused otherwise)."""
    model_type = hf.get("model_type", "llama")
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n_heads
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # transformers' order
    for key in ("rope_parameters", "rope_scaling"):  # transformers applies either; a scaling in one is not ignored
        rope_type = (hf.get(key) or {}).get("rope_type", (hf.get(key) or {}).get("type", "default"))
        if rope_type not in (None, "default"):
            raise CheckpointError(f"{model_type} rope scaling {rope_type!r} ({key}) is not supported")
    # the rope dict's theta first, then the top-level key (a v5 config has only the former; a hand-edited top-level
    # value beside it is ignored by transformers, so here too)
    theta = rope.get("rope_theta") or hf.get("rope_theta") or 10000.0
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{model_type} hidden_act={hf['hidden_act']!r} is not supported (expected silu)")
    window = sliding_window(hf, model_type)
    attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if model_type == "qwen2":  # q/k/v carry biases, o_proj and the MLP do not
        qkv_bias, bias = True, False
    else:  # seqlab's `bias` covers o_proj and the MLP together: the one HF leaves out is loaded as zeros
        qkv_bias, bias = attention_bias, attention_bias or mlp_bias
    max_len = hf.get("max_position_embeddings", 2048)
    return ModelConfig(
        arch="decoder", vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_ff=hf["intermediate_size"],
        attn_head_dim=head_dim if head_dim * n_heads != d else None, qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3", attention_window=window, max_seq_len=max_len, pos="rope",
        rope_base=float(theta), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), pre_norm=True, mlp="swiglu", activation="silu",
        bias=bias, tie_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=int_or_none(hf.get("bos_token_id")), eos_token_id=int_or_none(hf.get("eos_token_id")),
        pad_token_id=int_or_none(hf.get("pad_token_id")), extra={"source": f"hf:{model_type}"},
    )


def llama_weights(src: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    """HF Llama names -> seqlab. q/k/v are concatenated into ``qkv``; gate/up into ``mlp.up``."""
    src.prefix = "model."
    out = {"stack.embed.tok.weight": src.take("embed_tokens.weight")}
    for i in range(cfg.n_layers):
        b, h = f"stack.blocks.{i}", f"layers.{i}"
        out[f"{b}.attn_norm.weight"] = src.take(f"{h}.input_layernorm.weight")
        out[f"{b}.attn.qkv.weight"] = src.cat(*(f"{h}.self_attn.{p}_proj.weight" for p in "qkv"))
        out[f"{b}.attn.out.weight"] = src.take(f"{h}.self_attn.o_proj.weight")
        if cfg.qkv_bias:
            out[f"{b}.attn.qkv.bias"] = src.cat(*(f"{h}.self_attn.{p}_proj.bias" for p in "qkv"))
        if cfg.qk_norm:
            out[f"{b}.attn.q_norm.weight"] = src.take(f"{h}.self_attn.q_norm.weight")
            out[f"{b}.attn.k_norm.weight"] = src.take(f"{h}.self_attn.k_norm.weight")
        if cfg.bias:
            out[f"{b}.attn.out.bias"] = _bias_or_zeros(src, f"{h}.self_attn.o_proj", cfg.d_model)
            out[f"{b}.mlp.up.bias"] = torch.cat([_bias_or_zeros(src, f"{h}.mlp.{p}_proj", cfg.d_ff) for p in ("gate", "up")])
            out[f"{b}.mlp.down.bias"] = _bias_or_zeros(src, f"{h}.mlp.down_proj", cfg.d_model)
        out[f"{b}.mlp_norm.weight"] = src.take(f"{h}.post_attention_layernorm.weight")
        out[f"{b}.mlp.up.weight"] = src.cat(f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight")
        out[f"{b}.mlp.down.weight"] = src.take(f"{h}.mlp.down_proj.weight")
    out["stack.norm.weight"] = src.take("norm.weight")
    src.prefix = ""
    _lm_head(out, src, cfg, "lm_head.weight")
    return out


def _bias_or_zeros(src: _Tensors, name: str, size: int) -> Tensor:
    """A bias HF does not have (Llama's attention_bias without mlp_bias, or the reverse) is exactly zero."""
    return src.take(f"{name}.bias") if src.has(f"{name}.bias") else torch.zeros(size)


# ---------------------------------------------------------------------------------------------------- BERT
def bert_config(hf: dict) -> ModelConfig:
    act = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
           "swish": "silu"}
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"BERT position_embedding_type={hf['position_embedding_type']!r} is not supported")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        # BertLMHeadModel's causal self-attention (and cross-attention) would be run bidirectionally, silently
        field = "is_decoder" if hf.get("is_decoder") else "add_cross_attention"
        raise CheckpointError(f"BERT {field}=true (a causal BERT decoder) is not supported: seqlab's BERT is the "
                              "bidirectional encoder")
    return ModelConfig(
        arch="encoder", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 512), pos="learned", norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-12), pre_norm=False, embed_norm=True, mlp="gelu",
        activation=activation_name(act, hf.get("hidden_act", "gelu"), "BERT"), bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        lm_head_bias=True, mlm_head_transform=True, type_vocab_size=hf.get("type_vocab_size", 2),
        pad_token_id=hf.get("pad_token_id"), extra={"source": "hf:bert"},
    )


def bert_weights(src: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    src.prefix = "bert." if src.has("bert.embeddings.word_embeddings.weight") else ""
    out = {
        "stack.embed.tok.weight": src.take("embeddings.word_embeddings.weight"),
        "stack.embed.pos.weight": src.take("embeddings.position_embeddings.weight"),
        "stack.embed.token_type.weight": src.take("embeddings.token_type_embeddings.weight"),
    }
    _norm(out, "stack.embed.norm", src, "embeddings.LayerNorm")
    for i in range(cfg.n_layers):
        b, h = f"stack.blocks.{i}", f"encoder.layer.{i}"
        a = f"{h}.attention.self"
        out[f"{b}.attn.qkv.weight"] = src.cat(f"{a}.query.weight", f"{a}.key.weight", f"{a}.value.weight")
        out[f"{b}.attn.qkv.bias"] = src.cat(f"{a}.query.bias", f"{a}.key.bias", f"{a}.value.bias")
        _linear(out, f"{b}.attn.out", src, f"{h}.attention.output.dense", True)
        _norm(out, f"{b}.attn_norm", src, f"{h}.attention.output.LayerNorm")
        _linear(out, f"{b}.mlp.up", src, f"{h}.intermediate.dense", True)
        _linear(out, f"{b}.mlp.down", src, f"{h}.output.dense", True)
        _norm(out, f"{b}.mlp_norm", src, f"{h}.output.LayerNorm")
    src.prefix = ""
    if src.has("cls.predictions.bias"):
        _linear(out, "lm_head.transform.0", src, "cls.predictions.transform.dense", True)
        _norm(out, "lm_head.transform.2", src, "cls.predictions.transform.LayerNorm")
        out["lm_head.proj.bias"] = src.take("cls.predictions.bias")
        if src.has("cls.predictions.decoder.bias"):  # the bias the head's forward adds: the same tensor as the one
            out["lm_head.proj.bias"] = src.take("cls.predictions.decoder.bias")  # above, or (untied) the one used
        _lm_head(out, src, cfg, "cls.predictions.decoder.weight")
    return out


# ---------------------------------------------------------------------------------------------------- BART
def bart_config(hf: dict) -> ModelConfig:
    if hf.get("encoder_attention_heads") != hf.get("decoder_attention_heads") or hf.get("encoder_ffn_dim") != hf.get("decoder_ffn_dim"):
        raise CheckpointError("BART with different encoder/decoder heads or FFN sizes is not supported")
    if hf.get("add_final_layer_norm") or hf.get("normalize_before"):
        raise CheckpointError("BART variants with pre-norm / final layer norm (mBART) are not supported")
    act = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
           "swish": "silu"}  # gelu_pytorch_tanh: what seqlab's own BART export writes for gelu_tanh
    return ModelConfig(
        arch="encoder_decoder", vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"], n_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
        max_seq_len=hf["max_position_embeddings"], pos="learned", pos_offset=2, norm="layernorm", norm_eps=1e-5,
        pre_norm=False, embed_norm=True, scale_embeddings=bool(hf.get("scale_embedding", False)), mlp="gelu",
        activation=activation_name(act, hf.get("activation_function", "gelu"), "BART"), bias=True, tie_embeddings=True,
        lm_head_bias=True,
        pad_token_id=hf.get("pad_token_id"), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), decoder_start_token_id=hf.get("decoder_start_token_id"),
        extra={"source": "hf:bart"},
    )


def bart_weights(src: _Tensors, cfg: ModelConfig) -> dict[str, Tensor]:
    src.prefix = "model."
    out = {"shared.weight": src.take("shared.weight")}
    for side, n_layers in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
        _take_tied(src, f"{side}.embed_tokens.weight", out["shared.weight"], "model.shared.weight")
        out[f"{side}.embed.pos.weight"] = src.take(f"{side}.embed_positions.weight")
        _norm(out, f"{side}.embed.norm", src, f"{side}.layernorm_embedding")
        for i in range(n_layers):
            b, h = f"{side}.blocks.{i}", f"{side}.layers.{i}"
            out[f"{b}.attn.qkv.weight"] = src.cat(*(f"{h}.self_attn.{p}_proj.weight" for p in "qkv"))
            out[f"{b}.attn.qkv.bias"] = src.cat(*(f"{h}.self_attn.{p}_proj.bias" for p in "qkv"))
            _linear(out, f"{b}.attn.out", src, f"{h}.self_attn.out_proj", True)
            _norm(out, f"{b}.attn_norm", src, f"{h}.self_attn_layer_norm")
            if side == "decoder":
                _linear(out, f"{b}.cross_attn.q", src, f"{h}.encoder_attn.q_proj", True)
                out[f"{b}.cross_attn.kv.weight"] = src.cat(f"{h}.encoder_attn.k_proj.weight", f"{h}.encoder_attn.v_proj.weight")
                out[f"{b}.cross_attn.kv.bias"] = src.cat(f"{h}.encoder_attn.k_proj.bias", f"{h}.encoder_attn.v_proj.bias")
                _linear(out, f"{b}.cross_attn.out", src, f"{h}.encoder_attn.out_proj", True)
                _norm(out, f"{b}.cross_norm", src, f"{h}.encoder_attn_layer_norm")
            _linear(out, f"{b}.mlp.up", src, f"{h}.fc1", True)
            _linear(out, f"{b}.mlp.down", src, f"{h}.fc2", True)
            _norm(out, f"{b}.mlp_norm", src, f"{h}.final_layer_norm")
    src.prefix = ""
    out["lm_head.proj.bias"] = src.take("final_logits_bias").reshape(-1)
    _take_tied(src, "lm_head.weight", out["shared.weight"], "model.shared.weight")
    return out


# ---------------------------------------------------------------------------------------------------- loading
FAMILIES: dict[str, tuple[Callable[[dict], ModelConfig], Callable[[_Tensors, ModelConfig], dict]]] = {
    "gpt2": (gpt2_config, gpt2_weights),
    "llama": (llama_config, llama_weights),
    "mistral": (llama_config, llama_weights),
    "qwen2": (llama_config, llama_weights),
    "qwen3": (llama_config, llama_weights),
    "bert": (bert_config, bert_weights),
    "bart": (bart_config, bart_weights),
}

# Buffers and heads that HF files may carry but seqlab does not use.
_IGNORABLE = re.compile(
    r"(^|\.)(attn\.bias|attn\.masked_bias|position_ids|rotary_emb\.inv_freq)$|^(bert\.)?pooler\.|^cls\.seq_relationship\."
)


def config_from_hf(hf: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"unsupported Hugging Face model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    listed = eos_list(hf)
    hf = dict(hf)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        usable = vocab_ids(hf.get(key), hf.get("vocab_size", 0))  # of several, the first usable one is canonical
        hf[key] = usable[0] if usable else None
    try:
        cfg = FAMILIES[model_type][0](hf)
        cfg.extra.update(listed)
        return cfg
    except KeyError as e:  # a required field is absent: say which, not a bare KeyError
        raise CheckpointError(f"Hugging Face {model_type} config: required key {e.args[0]!r} is missing") from None


def convert_hf_state_dict(hf_config: dict, tensors: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """HF config + state dict -> (ModelConfig, seqlab state dict). Unknown leftover tensors raise, listed."""
    cfg = config_from_hf(hf_config)
    src = _Tensors(tensors)
    # (dispatch on the validated model_type)
    out = FAMILIES[hf_config["model_type"]][1](src, cfg)
    leftover = src.leftover(lambda k: bool(_IGNORABLE.search(k)))
    if leftover:
        raise CheckpointError(f"unknown tensors in the Hugging Face checkpoint: {leftover}")
    return cfg, out


def _read_hf_tensors(folder: Path) -> dict[str, Tensor]:
    single = folder / "model.safetensors"
    if single.is_file():
        return load_tensors(single)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_config_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and Path(v).name == v
                                                       for v in weight_map.values()):
            raise CheckpointError(f"{index}: no 'weight_map' object naming each tensor's shard file")
        shards = sorted(set(weight_map.values()))
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            tensors.update(load_tensors(folder / shard))
        return tensors
    raise CheckpointError(f"{folder}: no model.safetensors (pickled pytorch_model.bin files are never loaded)")


def load_hf(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """Load a Hugging Face model folder (``config.json`` + ``model.safetensors``) as a seqlab model.

    Heads absent from the file (a bare ``BertModel`` has no MLM head) keep their random initialisation and are
    recorded in ``model.config.extra["uninitialised"]``; the body is always fully loaded or the call fails.
    The EOS ids of ``generation_config.json`` are listed after the config's own, as HF's ``generate`` stops there.
    """
    refuse_gguf_file(path)
    folder = Path(path)
    hf = read_config_json(folder / "config.json")
    if (folder / "generation_config.json").is_file():
        hf = with_generation_ids(hf, read_config_json(folder / "generation_config.json"))
    try:
        config_from_hf(hf)  # a bad config fails before any weights are read, naming its file
    except ValueError as e:  # ConfigError and CheckpointError are both ValueErrors
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    tensors = _read_hf_tensors(folder)
    try:
        cfg, state = convert_hf_state_dict(hf, tensors)
    except ValueError as e:  # name the folder: the mapping's messages name only fields/tensors
        raise CheckpointError(f"{folder}: {e}") from None
    model = build_model(cfg)
    expected = model.state_dict()
    # a tied head weight is the embedding's; an untied one a bare BertModel lacks is as missing as the rest
    head_missing = [k for k in expected if k.startswith("lm_head.") and k not in state
                    and not (k == "lm_head.proj.weight" and cfg.tie_embeddings)]
    if head_missing and cfg.arch == "encoder":
        state.update({k: expected[k] for k in head_missing})
        cfg.extra["uninitialised"] = head_missing
    load_state_into(model, state, str(folder))
    return model.to(device=device, dtype=dtype).eval()
