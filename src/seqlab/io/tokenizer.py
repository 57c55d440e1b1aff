"""GGUF tokenizer metadata -> seqlab's one :class:`~seqlab.data.tokenizer.Tokenizer`.

The vocabulary, merges and token types stored in a GGUF file become a byte-level BPE ``tokenizers.Tokenizer`` with
the pre-tokenizer named by ``tokenizer.ggml.pre``; the special ids, the BOS/EOS rule and the chat template come
along. Parsing model files is the edge's job (io/); the Tokenizer class itself lives low, in data/.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from seqlab.data.byte_lengths import bytes_to_unicode
from seqlab.data.tokenizer import Tokenizer, TokenizerError, special_post_processor

__all__ = ["GGUF_PRE_TOKENIZERS", "LLAMA3_FAMILY", "gguf_pre_name", "tokenizer_from_gguf"]

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's split regexes, by ``tokenizer.ggml.pre``. Byte-level BPE merges were learned on these pieces, so
# splitting differently would produce valid but different (worse) tokenizations.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre():
    # SmolLM / StarCoder: every digit is its own piece, then GPT-2's split (the original tokenizer.json says
    # Sequence[Digits(individual_digits=True), ByteLevel]; llama.cpp spells it as the regex "\p{N}" first).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _regex_pre(pattern: str):
    return lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


GGUF_PRE_TOKENIZERS = {
    "default": _gpt2_pre,  # llama.cpp chains four regexes for it (a fallback it warns about), GPT-2's among them
    "gpt-2": _gpt2_pre,  # llama.cpp's name, and so the one written; "gpt2" is read too (files from other writers)
    "gpt2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "refact": _digits_then_gpt2_pre,
    "codeshell": _digits_then_gpt2_pre,
    "llama3": _regex_pre(_LLAMA3_SPLIT),
    "llama-v3": _regex_pre(_LLAMA3_SPLIT),
    "llama-bpe": _regex_pre(_LLAMA3_SPLIT),
    "falcon3": _regex_pre(_LLAMA3_SPLIT),
    "falcon-h1": _regex_pre(_LLAMA3_SPLIT),
    "pixtral": _regex_pre(_LLAMA3_SPLIT),
    "midm-2.0": _regex_pre(_LLAMA3_SPLIT),
    "lfm2": _regex_pre(_LLAMA3_SPLIT),
    "smaug-bpe": _regex_pre(_LLAMA3_SPLIT),  # Llama 3's split with every merge applied
    "qwen2": _regex_pre(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _regex_pre(_QWEN2_SPLIT),
    "kormo": _regex_pre(_QWEN2_SPLIT),
    "megrez": _regex_pre(_QWEN2_SPLIT),
}

# llama.cpp's Llama 3 family: a piece already in the vocabulary is one token, whatever the merges would make of it
# (tokenizer.json's "ignore_merges": true), and BOS is added unless the file says otherwise
LLAMA3_FAMILY = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"})


def _splitting(pre_tokenizer: Any) -> Any:
    """A pre-tokenizer's tokenizer.json form without ``trim_offsets``, which moves offsets, never a split."""
    if isinstance(pre_tokenizer, dict):
        return {k: _splitting(v) for k, v in pre_tokenizer.items() if k != "trim_offsets"}
    if isinstance(pre_tokenizer, list):
        return [_splitting(v) for v in pre_tokenizer]
    return pre_tokenizer


def _spec_of(build) -> Any:
    probe = Backend(models.BPE())
    probe.pre_tokenizer = build()
    return _splitting(json.loads(probe.to_str())["pre_tokenizer"])


def gguf_pre_name(backend: Backend) -> str | None:
    """The ``tokenizer.ggml.pre`` that splits text as ``backend``'s pre-tokenizer does (the first of equivalent
    names, "gpt-2" before "default"), or None when llama.cpp knows none that seqlab does. A GGUF file read back
    splits by that name, so writing another would tokenize the same text differently (SmolLM2's "smollm" keeps
    every digit apart; GPT-2's split does not)."""
    doc = json.loads(backend.to_str())
    spec = _splitting(doc.get("pre_tokenizer"))
    ignores_merges = bool((doc.get("model") or {}).get("ignore_merges"))
    names = [n for n in GGUF_PRE_TOKENIZERS if n != "default"] + ["default"]
    return next((name for name in names if _spec_of(GGUF_PRE_TOKENIZERS[name]) == spec
                 and (name in LLAMA3_FAMILY) == ignores_merges), None)


def tokenizer_from_gguf(metadata: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
    """Build from GGUF ``tokenizer.ggml.*`` metadata (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{source}: metadata key 'tokenizer.ggml.model' is missing (no tokenizer in the file)")
    if kind != "gpt2":
        raise TokenizerError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
        )
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges = list(metadata.get("tokenizer.ggml.merges") or [])
    if not tokens:  # merges may be empty: a byte-level vocabulary without merges (seqlab's byte tokenizer)
        raise TokenizerError(f"{source}: 'tokenizer.ggml.tokens' is missing or empty")
    types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (rare mislabelled files) is respelled byte by byte, as HF does; not a
    # control or user-defined one: llama.cpp stores those as their text ("<｜begin▁of▁sentence｜>", a tool tag with a
    # space), which an added token must match whole (respelled, it matched nothing and the text became 34 byte ids).
    spelled = [t if set(t) <= alphabet or ty in (_CONTROL, _USER_DEFINED)
               else "".join(spelling[b] for b in t.encode("utf-8")) for t, ty in zip(tokens, types)]
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        vocab.setdefault(t, i)
    pairs = []
    for j, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{source}: tokenizer.ggml.merges[{j}] = {m!r} is not 'left right'")
        pairs.append((parts[0], parts[1]))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        warnings.warn(f"{source}: unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split", stacklevel=2)
        pre = "default"
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre in LLAMA3_FAMILY))
    backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) are matched whole and are "special" (skippable on decode);
    # user-defined ones are matched whole but kept as text.
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(spelled, types) if ty == _CONTROL]
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(spelled, types) if ty == _USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)

    def tid(key: str) -> int | None:
        v = metadata.get(f"tokenizer.ggml.{key}")
        return int(v) if v is not None else None

    bos, eos = tid("bos_token_id"), tid("eos_token_id")
    for role, value in (("bos", bos), ("eos", eos)):  # before the post-processor spells them
        if value is not None and not 0 <= value < len(spelled):
            raise TokenizerError(f"{source}: tokenizer.ggml.{role}_token_id={value} is outside the vocabulary "
                                 f"[0, {len(spelled)})")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", pre in LLAMA3_FAMILY))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = special_post_processor(spelled.__getitem__, bos if add_bos else None,
                                                    eos if add_eos else None)
    return Tokenizer(
        backend, bos_id=bos, eos_id=eos, pad_id=tid("padding_token_id"), unk_id=tid("unknown_token_id"),
        chat_template=metadata.get("tokenizer.chat_template") or "", add_bos_token=add_bos,
        add_eos_token=add_eos, name=source,
    )
