"""Reading a Hugging Face ``config.json``'s fields the way seqlab's import needs them: activation names, special
ids given as lists.

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


def eos_list(hf: dict) -> dict[str, list[int]]:
    """Every EOS id where the config lists several (Llama 3: end of text, of a message, of a turn): generation
    stops at any of them, as HF's does (``GenerationConfig.eos_ids`` reads ``extra["eos_token_ids"]``)."""
    eos = hf.get("eos_token_id")
    if not isinstance(eos, list):
        return {}
    ids = [int(e) for e in eos if isinstance(e, int) and 0 <= e < hf.get("vocab_size", 0)]
    return {"eos_token_ids": ids} if len(ids) > 1 else {}
