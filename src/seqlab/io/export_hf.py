"""Export seqlab models as Hugging Face folders: ``config.json``, ``model.safetensors``, ``generation_config.json``.

The mapping is the inverse of :mod:`seqlab.io.hf`: fused projections are split again (``qkv`` -> q/k/v,
``mlp.up`` -> gate/up), GPT-2's Conv1D weights are transposed back, and each family gets its own ``model_type``:

- ``llama`` (``qwen2`` / ``qwen3`` where those knobs are used) for RoPE + RMSNorm + SwiGLU pre-norm decoders,
- ``gpt2`` for learned-position LayerNorm GELU pre-norm decoders,
- ``bert`` for post-norm encoders with BERT's MLM head, ``bart`` for post-norm encoder-decoders.

A bias HF requires but seqlab lacks is written as zeros (exactly the same function); anything HF cannot express
(a non-zero bias it has no slot for, a different norm, an unsupported activation) raises :class:`ExportError`
naming the ModelConfig field, because a folder that loads but computes something else is worse than no folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from seqlab.config import ModelConfig
from seqlab.io.checkpoint import save_tensors
from seqlab.runtime import atomic_write_text


class ExportError(ValueError):
    """The model cannot be written in the requested format; the message names the ModelConfig field."""


def _require(cond: bool, field: str, value, family: str, why: str) -> None:
    if not cond:
        raise ExportError(f"cannot export as {family}: ModelConfig.{field}={value!r} ({why})")


def _zero_or_refuse(sd: dict, name: str, field: str, family: str) -> None:
    """A tensor HF has no slot for may be dropped only if it is exactly zero."""
    if name in sd and sd[name].abs().max().item() != 0:
        raise ExportError(f"cannot export as Hugging Face {family}: ModelConfig.{field}=True gives {name} non-zero "
                          f"values, and {family} has no such parameter")


def _bias(sd: dict, name: str, size: int) -> Tensor:
    return sd[name] if name in sd else torch.zeros(size)


def _ids(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ---------------------------------------------------------------------------------------------------- Llama
def llama_model_type(cfg: ModelConfig, fam: str = "Hugging Face llama") -> str:
    """``llama``, ``qwen2`` or ``qwen3``; ExportError naming the first field a Llama cannot have."""
    _require(cfg.arch == "decoder", "arch", cfg.arch, fam, "Llama is a decoder")
    for field, want in (("pos", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("activation", "silu"),
                        ("pre_norm", True), ("final_norm", True), ("embed_norm", False), ("scale_embeddings", False),
                        ("lm_head_bias", False), ("mlm_head_transform", False), ("type_vocab_size", 0)):
        _require(getattr(cfg, field) == want, field, getattr(cfg, field), fam, f"Llama needs {want!r}")
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias and not cfg.bias and cfg.attn_head_dim is None:
        return "qwen2"
    return "llama"


def llama_hf_config(cfg: ModelConfig, model_type: str) -> dict:
    doc = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0, **_ids(cfg),
    }
    if model_type == "llama":
        doc.update(attention_bias=bool(cfg.qkv_bias or cfg.bias), mlp_bias=bool(cfg.bias))
    elif model_type == "qwen3":
        doc.update(attention_bias=bool(cfg.qkv_bias or cfg.bias), use_sliding_window=False, sliding_window=None)
    else:
        doc.update(use_sliding_window=False, sliding_window=None)
    return doc


def llama_hf_weights(cfg: ModelConfig, sd: dict, model_type: str) -> dict[str, Tensor]:
    H, Hkv, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    attn_bias = model_type == "qwen2" or (model_type in ("llama", "qwen3") and (cfg.qkv_bias or cfg.bias))
    mlp_bias = model_type == "llama" and cfg.bias
    out = {"model.embed_tokens.weight": sd["stack.embed.tok.weight"], "model.norm.weight": sd["stack.norm.weight"]}
    for i in range(cfg.n_layers):
        b, h = f"stack.blocks.{i}", f"model.layers.{i}"
        out[f"{h}.input_layernorm.weight"] = sd[f"{b}.attn_norm.weight"]
        out[f"{h}.post_attention_layernorm.weight"] = sd[f"{b}.mlp_norm.weight"]
        sizes = (H * D, Hkv * D, Hkv * D)
        for p, w in zip("qkv", sd[f"{b}.attn.qkv.weight"].split(sizes)):
            out[f"{h}.self_attn.{p}_proj.weight"] = w
        out[f"{h}.self_attn.o_proj.weight"] = sd[f"{b}.attn.out.weight"]
        if attn_bias:
            for p, bias in zip("qkv", _bias(sd, f"{b}.attn.qkv.bias", sum(sizes)).split(sizes)):
                out[f"{h}.self_attn.{p}_proj.bias"] = bias
            if model_type != "qwen2":
                out[f"{h}.self_attn.o_proj.bias"] = _bias(sd, f"{b}.attn.out.bias", cfg.d_model)
        if model_type == "qwen2":
            _zero_or_refuse(sd, f"{b}.attn.out.bias", "bias", model_type)
        if cfg.qk_norm:
            out[f"{h}.self_attn.q_norm.weight"] = sd[f"{b}.attn.q_norm.weight"]
            out[f"{h}.self_attn.k_norm.weight"] = sd[f"{b}.attn.k_norm.weight"]
        gate, up = sd[f"{b}.mlp.up.weight"].split(F)
        out[f"{h}.mlp.gate_proj.weight"], out[f"{h}.mlp.up_proj.weight"] = gate, up
        out[f"{h}.mlp.down_proj.weight"] = sd[f"{b}.mlp.down.weight"]
        if mlp_bias:
            gate_b, up_b = _bias(sd, f"{b}.mlp.up.bias", 2 * F).split(F)
            out[f"{h}.mlp.gate_proj.bias"], out[f"{h}.mlp.up_proj.bias"] = gate_b, up_b
            out[f"{h}.mlp.down_proj.bias"] = _bias(sd, f"{b}.mlp.down.bias", cfg.d_model)
        else:
            for name in (f"{b}.mlp.up.bias", f"{b}.mlp.down.bias"):
                _zero_or_refuse(sd, name, "bias", model_type)
    out["lm_head.weight"] = sd["lm_head.proj.weight"]
    return out


# ---------------------------------------------------------------------------------------------------- GPT-2
_GPT2_ACT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _gpt2_family(cfg: ModelConfig) -> str:
    fam = "Hugging Face gpt2"
    _require(cfg.arch == "decoder", "arch", cfg.arch, fam, "GPT-2 is a decoder")
    for field, want in (("pos", "learned"), ("pos_offset", 0), ("norm", "layernorm"), ("mlp", "gelu"),
                        ("pre_norm", True), ("final_norm", True), ("embed_norm", False), ("scale_embeddings", False),
                        ("lm_head_bias", False), ("mlm_head_transform", False), ("type_vocab_size", 0),
                        ("qk_norm", False), ("attn_head_dim", None), ("n_kv_heads", cfg.n_heads)):
        _require(getattr(cfg, field) == want, field, getattr(cfg, field), fam, f"GPT-2 needs {want!r}")
    _require(cfg.activation in _GPT2_ACT, "activation", cfg.activation, fam, "no GPT-2 equivalent")
    return "gpt2"


def gpt2_hf_config(cfg: ModelConfig, model_type: str) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff, "activation_function": _GPT2_ACT[cfg.activation], "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, **_ids(cfg),
    }


def gpt2_hf_weights(cfg: ModelConfig, sd: dict, model_type: str) -> dict[str, Tensor]:
    d, F = cfg.d_model, cfg.d_ff
    out = {"transformer.wte.weight": sd["stack.embed.tok.weight"], "transformer.wpe.weight": sd["stack.embed.pos.weight"],
           "transformer.ln_f.weight": sd["stack.norm.weight"], "transformer.ln_f.bias": sd["stack.norm.bias"]}
    for i in range(cfg.n_layers):
        b, h = f"stack.blocks.{i}", f"transformer.h.{i}"
        for ours, theirs, size in (("attn.qkv", "attn.c_attn", 3 * d), ("attn.out", "attn.c_proj", d),
                                   ("mlp.up", "mlp.c_fc", F), ("mlp.down", "mlp.c_proj", d)):
            out[f"{h}.{theirs}.weight"] = sd[f"{b}.{ours}.weight"].t().contiguous()  # Conv1D computes x @ W
            out[f"{h}.{theirs}.bias"] = _bias(sd, f"{b}.{ours}.bias", size)
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{h}.{theirs}.weight"], out[f"{h}.{theirs}.bias"] = sd[f"{b}.{ours}.weight"], sd[f"{b}.{ours}.bias"]
    out["lm_head.weight"] = sd["lm_head.proj.weight"]
    return out


# ---------------------------------------------------------------------------------------------------- BERT / BART
_BERT_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}


def _post_norm_family(cfg: ModelConfig, family: str, arch: str, pos_offset: int) -> str:
    fam = f"Hugging Face {family}"
    _require(cfg.arch == arch, "arch", cfg.arch, fam, f"{fam} is an {arch}")
    for field, want in (("pos", "learned"), ("pos_offset", pos_offset), ("norm", "layernorm"), ("mlp", "gelu"),
                        ("pre_norm", False), ("final_norm", False), ("embed_norm", True), ("bias", True),
                        ("qkv_bias", True), ("lm_head_bias", True), ("qk_norm", False), ("attn_head_dim", None),
                        ("n_kv_heads", cfg.n_heads)):
        _require(getattr(cfg, field) == want, field, getattr(cfg, field), fam, f"{fam} needs {want!r}")
    _require(cfg.activation in _BERT_ACT, "activation", cfg.activation, fam, "no equivalent")
    return family


def _bert_family(cfg: ModelConfig) -> str:
    family, fam = _post_norm_family(cfg, "bert", "encoder", 0), "Hugging Face bert"
    _require(cfg.mlm_head_transform, "mlm_head_transform", cfg.mlm_head_transform, fam, "BERT's MLM head has one")
    _require(not cfg.scale_embeddings, "scale_embeddings", cfg.scale_embeddings, fam, "BERT does not scale")
    return family


def _bart_family(cfg: ModelConfig) -> str:
    family, fam = _post_norm_family(cfg, "bart", "encoder_decoder", 2), "Hugging Face bart"
    _require(cfg.norm_eps == 1e-5, "norm_eps", cfg.norm_eps, fam, "BART's LayerNorms use 1e-5")
    _require(cfg.tie_embeddings, "tie_embeddings", cfg.tie_embeddings, fam, "BART ties its LM head")
    _require(not cfg.mlm_head_transform, "mlm_head_transform", cfg.mlm_head_transform, fam, "BART has none")
    _require(cfg.type_vocab_size == 0, "type_vocab_size", cfg.type_vocab_size, fam, "BART has no token types")
    return family


def bare_encoder(cfg: ModelConfig) -> bool:
    """Whether the MLM head was never loaded (``io.hf.load_hf`` of a bare ``BertModel``): its weights are random, so
    the export is the encoder alone, as the source was, not a ``BertForMaskedLM`` whose fill-mask is noise."""
    return any(k.startswith("lm_head.") for k in cfg.extra.get("uninitialised", ()))


def bert_hf_config(cfg: ModelConfig, model_type: str) -> dict:
    return {
        "architectures": ["BertModel" if bare_encoder(cfg) else "BertForMaskedLM"], "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff, "hidden_act": _BERT_ACT[cfg.activation], "layer_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": max(cfg.type_vocab_size, 1),
        "position_embedding_type": "absolute", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings, "pad_token_id": cfg.pad_token_id,
    }


def bert_hf_weights(cfg: ModelConfig, sd: dict, model_type: str) -> dict[str, Tensor]:
    d = cfg.d_model
    token_type = sd.get("stack.embed.token_type.weight", torch.zeros(1, d))  # one zero row adds nothing
    out = {"bert.embeddings.word_embeddings.weight": sd["stack.embed.tok.weight"],
           "bert.embeddings.position_embeddings.weight": sd["stack.embed.pos.weight"],
           "bert.embeddings.token_type_embeddings.weight": token_type}
    _norm_out(out, "bert.embeddings.LayerNorm", sd, "stack.embed.norm")
    for i in range(cfg.n_layers):
        b, h = f"stack.blocks.{i}", f"bert.encoder.layer.{i}"
        _split_qkv(out, sd, f"{b}.attn.qkv", [f"{h}.attention.self.{p}" for p in ("query", "key", "value")], d)
        _linear_out(out, f"{h}.attention.output.dense", sd, f"{b}.attn.out")
        _norm_out(out, f"{h}.attention.output.LayerNorm", sd, f"{b}.attn_norm")
        _linear_out(out, f"{h}.intermediate.dense", sd, f"{b}.mlp.up")
        _linear_out(out, f"{h}.output.dense", sd, f"{b}.mlp.down")
        _norm_out(out, f"{h}.output.LayerNorm", sd, f"{b}.mlp_norm")
    if bare_encoder(cfg):  # BertModel's own names, as in the folder it came from
        return {k.removeprefix("bert."): v for k, v in out.items()}
    _linear_out(out, "cls.predictions.transform.dense", sd, "lm_head.transform.0")
    _norm_out(out, "cls.predictions.transform.LayerNorm", sd, "lm_head.transform.2")
    out["cls.predictions.decoder.weight"] = sd["lm_head.proj.weight"]
    out["cls.predictions.bias"] = sd["lm_head.proj.bias"]
    out["cls.predictions.decoder.bias"] = sd["lm_head.proj.bias"].clone()  # the one HF's head adds when untied
    return out


def bart_hf_config(cfg: ModelConfig, model_type: str) -> dict:
    return {
        "architectures": ["BartForConditionalGeneration"], "model_type": "bart", "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model, "encoder_layers": cfg.n_layers, "decoder_layers": cfg.n_decoder_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "activation_function": _BERT_ACT[cfg.activation],
        "max_position_embeddings": cfg.max_seq_len, "scale_embedding": cfg.scale_embeddings, "dropout": 0.0,
        "attention_dropout": 0.0, "activation_dropout": 0.0, "tie_word_embeddings": True,
        "decoder_start_token_id": cfg.decoder_start_token_id, "forced_eos_token_id": None, **_ids(cfg),
    }


def bart_hf_weights(cfg: ModelConfig, sd: dict, model_type: str) -> dict[str, Tensor]:
    d = cfg.d_model
    out = {"model.shared.weight": sd["shared.weight"], "final_logits_bias": sd["lm_head.proj.bias"][None],
           "lm_head.weight": sd["lm_head.proj.weight"]}
    for side, n_layers in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
        m = f"model.{side}"
        out[f"{m}.embed_positions.weight"] = sd[f"{side}.embed.pos.weight"]
        _norm_out(out, f"{m}.layernorm_embedding", sd, f"{side}.embed.norm")
        for i in range(n_layers):
            b, h = f"{side}.blocks.{i}", f"{m}.layers.{i}"
            _split_qkv(out, sd, f"{b}.attn.qkv", [f"{h}.self_attn.{p}_proj" for p in "qkv"], d)
            _linear_out(out, f"{h}.self_attn.out_proj", sd, f"{b}.attn.out")
            _norm_out(out, f"{h}.self_attn_layer_norm", sd, f"{b}.attn_norm")
            if side == "decoder":
                _linear_out(out, f"{h}.encoder_attn.q_proj", sd, f"{b}.cross_attn.q")
                _split_qkv(out, sd, f"{b}.cross_attn.kv", [f"{h}.encoder_attn.{p}_proj" for p in "kv"], d)
                _linear_out(out, f"{h}.encoder_attn.out_proj", sd, f"{b}.cross_attn.out")
                _norm_out(out, f"{h}.encoder_attn_layer_norm", sd, f"{b}.cross_norm")
            _linear_out(out, f"{h}.fc1", sd, f"{b}.mlp.up")
            _linear_out(out, f"{h}.fc2", sd, f"{b}.mlp.down")
            _norm_out(out, f"{h}.final_layer_norm", sd, f"{b}.mlp_norm")
    return out


def _linear_out(out: dict, dst: str, sd: dict, src: str) -> None:
    out[f"{dst}.weight"], out[f"{dst}.bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]


_norm_out = _linear_out  # a LayerNorm is (weight, bias) too


def _split_qkv(out: dict, sd: dict, src: str, dsts: list[str], d: int) -> None:
    for dst, w, b in zip(dsts, sd[f"{src}.weight"].split(d), sd[f"{src}.bias"].split(d)):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = w, b


# ---------------------------------------------------------------------------------------------------- writing
_Family = tuple[Callable[[ModelConfig], str], Callable[[ModelConfig, str], dict], Callable[[ModelConfig, dict, str], dict]]
FAMILIES: dict[str, _Family] = {
    "llama": (llama_model_type, llama_hf_config, llama_hf_weights),
    "gpt2": (_gpt2_family, gpt2_hf_config, gpt2_hf_weights),
    "bert": (_bert_family, bert_hf_config, bert_hf_weights),
    "bart": (_bart_family, bart_hf_config, bart_hf_weights),
}


def hf_family(cfg: ModelConfig) -> tuple[str, str]:
    """(family, HF model_type) for ``cfg``; ExportError naming the field that rules out the closest family."""
    closest = {"decoder": "llama" if cfg.pos == "rope" else "gpt2", "encoder": "bert", "encoder_decoder": "bart"}[cfg.arch]
    return closest, FAMILIES[closest][0](cfg)


def to_hf(model: nn.Module) -> tuple[dict, dict[str, Tensor]]:
    """(HF ``config.json`` dict, HF state dict) for a seqlab model."""
    cfg: ModelConfig = model.config
    family, model_type = hf_family(cfg)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    tensors = FAMILIES[family][2](cfg, sd, model_type)
    return FAMILIES[family][1](cfg, model_type), {k: v.contiguous() for k, v in tensors.items()}


def generation_config(cfg: ModelConfig, eot_id: int | None = None) -> dict:
    """Greedy by default; an end-of-turn token (ChatML's ``<|im_end|>``) also ends generation."""
    eos = [i for i in (*cfg.extra.get("eos_token_ids", [cfg.eos_token_id]), eot_id) if i is not None]
    eos = list(dict.fromkeys(eos))
    doc = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
           "pad_token_id": cfg.pad_token_id, "do_sample": False}
    if cfg.arch == "encoder_decoder":
        doc["decoder_start_token_id"] = cfg.decoder_start_token_id
    return doc


def export_hf(model: nn.Module, out_dir: str | os.PathLike, eot_id: int | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``generation_config.json`` to ``out_dir``.

    Tied weights are written once under the token table's name: HF re-ties them from ``tie_word_embeddings``.
    """
    hf_cfg, tensors = to_hf(model)
    if model.config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
        tensors.pop("cls.predictions.decoder.weight", None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(hf_cfg, indent=2) + "\n")
    atomic_write_text(out / "generation_config.json",
                      json.dumps(generation_config(model.config, eot_id), indent=2) + "\n")
    return out
