"""One assistant turn, the way every seqlab front end produces it (``seqlab chat`` and ``seqlab serve``).

Why a module of its own: a chat reply is more than generation. The conversation is rendered with the model's own
chat template, the turn ends at any of the template's end-of-turn tokens (not only the file's EOS), and the reply is
the decoded text without special tokens, stripped. Two front ends that did any of these differently would give
different answers to the same question; both import them from here. The tokenizer is duck-typed
(``apply_chat_template``, ``decode``, ``token_to_id``, ``eos_id``, ``eot_id``, ``special_ids``), so this layer needs nothing from ``io``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from seqlab.generate.config import GenerationConfig

# Chat-turn terminators used by common templates; any of them present in the vocabulary ends a reply.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<end_of_turn>", "</s>")


def end_ids(tokenizer, model_config=None) -> list[int]:
    """Ids that end a completion: the tokenizer's EOS and end-of-turn, and every EOS the model's config lists (a
    Hugging Face config may list several: Llama 3's end of text, end of message and end of turn)."""
    ids = [i for i in (tokenizer.eos_id, tokenizer.eot_id) if i is not None]
    if model_config is not None:
        ids += GenerationConfig().eos_ids(model_config)
    return list(dict.fromkeys(ids))


def turn_end_ids(tokenizer, model_config=None) -> list[int]:
    """Ids that end an assistant turn: :func:`end_ids`, and any standard terminator in the vocabulary."""
    ids = end_ids(tokenizer, model_config)
    for tok in TURN_END_TOKENS:
        i = tokenizer.token_to_id(tok)
        if i is not None and i in tokenizer.special_ids:
            ids.append(i)
    return list(dict.fromkeys(ids))


def chat_prompt_ids(tokenizer, messages: Iterable[Mapping[str, Any]]) -> list[int]:
    """The conversation rendered by the model's template, ending with the assistant's generation prompt."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)


def reply_text(tokenizer, new_ids: Iterable[int], stop_ids: Iterable[int] = ()) -> str:
    """The assistant's reply: generated ids minus turn terminators, decoded without special tokens, stripped."""
    stop = set(stop_ids)
    return tokenizer.decode([t for t in new_ids if t not in stop], skip_special_tokens=True).strip()
