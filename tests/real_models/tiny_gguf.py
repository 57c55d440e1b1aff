"""Write tiny Llama GGUF files the way llama.cpp's converter does, for fast format and error-path tests.

The writer is the `gguf` package's own ``GGUFWriter``; the Q/K row permutation is llama.cpp's ``permute`` from
convert_hf_to_gguf.py, written out here independently of seqlab's inverse.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from seqlab.data.byte_lengths import bytes_to_unicode

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the bytes 0..255, in byte order (the base of a byte-level BPE vocab)."""
    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ Ġ"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = CONTROL + byte_alphabet()
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    return tokens, types, MERGES


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (n_head already set to n_kv_heads for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tiny_llama_state(n_layers=2, d=64, n_heads=4, n_kv=2, d_ff=96, vocab=None, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = vocab or len(tiny_vocab()[0])
    hd = d // n_heads
    w = lambda *s: (rng.standard_normal(s) * 0.08).astype(np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": 1 + w(d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": 1 + w(d), p + "post_attention_layernorm.weight": 1 + w(d),
            p + "self_attn.q_proj.weight": w(n_heads * hd, d), p + "self_attn.k_proj.weight": w(n_kv * hd, d),
            p + "self_attn.v_proj.weight": w(n_kv * hd, d), p + "self_attn.o_proj.weight": w(d, n_heads * hd),
            p + "mlp.gate_proj.weight": w(d_ff, d), p + "mlp.up_proj.weight": w(d_ff, d), p + "mlp.down_proj.weight": w(d, d_ff),
        }
    return sd


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[mod]}.{kind}"


def write_tiny_llama(path: Path, arch: str = "llama", n_layers=2, d=64, n_heads=4, n_kv=2, d_ff=96,
                     qtypes: dict[str, gguf.GGMLQuantizationType] | None = None, extra_tensors: dict | None = None,
                     raw_tensors: dict | None = None, seed=0) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF; returns the HF-convention float32 state (after any quantisation round trip).

    ``qtypes`` maps GGUF tensor names to a quantisation type (default F32). ``raw_tensors`` maps a name to
    ``(uint8 bytes array, GGMLQuantizationType)`` written as is (for unsupported-type tests).
    """
    tokens, types, merges = tiny_vocab()
    sd = hf_tiny_llama_state(n_layers, d, n_heads, n_kv, d_ff, len(tokens), seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // n_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    qtypes = qtypes or {}
    out = {}
    for hf, value in sd.items():
        name = gguf_name(hf)
        stored = value
        if ".attn_q." in name:
            stored = llamacpp_permute(value, n_heads)
        elif ".attn_k." in name:
            stored = llamacpp_permute(value, n_kv)
        q = qtypes.get(name, gguf.GGMLQuantizationType.F32)
        if q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, stored)
            out[hf] = value
        else:
            packed = gguf.quants.quantize(stored, q)
            w.add_tensor(name, packed, raw_dtype=q)
            # Blocks run along rows and the permutation only moves whole rows, so the round-tripped HF-order weights
            # are the round trip of the HF-order matrix itself (no inverse permutation needed here).
            back = gguf.quants.dequantize(gguf.quants.quantize(value, q), q).reshape(value.shape)
            out[hf] = back.astype(np.float32)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    for name, (raw, q) in (raw_tensors or {}).items():
        w.add_tensor(name, raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
