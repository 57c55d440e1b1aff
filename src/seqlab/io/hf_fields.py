"""Reading a Hugging Face ``config.json``'s fields the way seqlab's import needs them: activation names, special
ids given as lists, a sliding window.

Why apart from ``hf.py``: these are the config's vocabulary, shared by every family's reader there.
"""

from __future__ import annotations

from seqlab.runtime.errors import CheckpointError


def activation_name(table: dict[str, str], name: str, family: str) -> str:
    """seqlab's name for a config's activation, or a refusal naming the ones this family's import reads."""
    if name not in table:
        raise CheckpointError(f"{family} activation {name!r} is not supported (supported: {', '.join(table)})")
    return table[name]


def int_or_none(value: object) -> int | None:
    if isinstance(value, list):  # some configs list several EOS ids; the first is the canonical one
        value = value[0] if value else None
    return value


def vocab_ids(value: object, vocab_size: int) -> list[int]:
    """The ids ``value`` names (one id or a list) that lie inside the vocabulary: toy configs keep GPT-2's 50256
    with a smaller vocabulary, and such an id cannot be used."""
    listed = value if isinstance(value, list) else [value]
    return [v for v in listed if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size]


def eos_list(hf: dict) -> dict[str, list[int]]:
    """Every EOS id where the config lists several (Llama 3: end of text, of a message, of a turn): generation
    stops at any of them, as HF's does (``GenerationConfig.eos_ids`` reads ``extra["eos_token_ids"]``)."""
    eos = hf.get("eos_token_id")
    if not isinstance(eos, list):
        return {}
    ids = vocab_ids(eos, hf.get("vocab_size", 0))
    return {"eos_token_ids": ids} if len(ids) > 1 else {}


def with_generation_ids(hf: dict, generation: dict) -> dict:
    """``hf`` with the EOS ids of ``generation_config.json`` listed after its own, and its pad id where the config
    has none.

    Why: HF's ``generate`` stops at the generation config's EOS ids, and some chat models list their end of turn
    only there (Llama 3 Instruct: ``config.json`` says 128001, ``generation_config.json`` adds 128009), so a
    reply would otherwise run on past its turn. The config's own id stays first: it is the one training appends.
    Qwen2.5 keeps its pad id there only: HF pads finished rows with it and reads it as padding in a prompt.
    """
    vocab = hf.get("vocab_size", 0)
    own = vocab_ids(hf.get("eos_token_id"), vocab)
    ids = own + [e for e in vocab_ids(generation.get("eos_token_id"), vocab) if e not in own]
    out = {**hf, "eos_token_id": ids} if len(ids) > len(own) else hf
    pad = vocab_ids(generation.get("pad_token_id"), vocab)
    if hf.get("pad_token_id") is None and len(pad) == 1:
        out = {**out, "pad_token_id": pad[0]}
    return out


def sliding_window(hf: dict, model_type: str) -> int | None:
    """The window a sliding-window model attends within, or None.

    seqlab attends to every earlier position. That computes the window's result only while a sequence fits in the
    window: one shorter than the context is refused here, a longer one becomes ``attention_window``, past which the
    model refuses sequences (rotary tables grow past ``max_seq_len``, so the context alone does not stop them).
    """
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or []
    if model_type in ("qwen2", "qwen3"):
        applies = bool(hf.get("use_sliding_window")) or "sliding_attention" in layer_types
    else:
        applies = model_type == "mistral" or bool(hf.get("use_sliding_window")) or "sliding_attention" in layer_types
    if not applies or window is None:
        return None
    if window < hf.get("max_position_embeddings", 2048):
        raise CheckpointError(f"{model_type} sliding_window={window} (< max_position_embeddings="
                              f"{hf.get('max_position_embeddings')}) is not supported: seqlab attends to the full context")
    return int(window)
