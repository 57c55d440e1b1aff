"""Supervised fine-tuning on chats: the loss covers only what the assistant says (incl. its end-of-turn token).

Rendering and span finding live in ``seqlab.data.chat`` (:func:`tokenize_chat`: the chat template runs in Jinja's
sandbox; assistant spans come from rendering incrementally). This objective is CLM on those labels: label j = token
j inside an assistant span, else -100, unshifted; the causal shift happens in ``clm.next_token_labels`` as for every
next-token objective.
"""

from __future__ import annotations

from typing import Any, Sequence

from seqlab.data.chat import ChatTemplateSpanError, render_with_spans, tokenize_chat
from seqlab.objectives.clm import CausalLM

__all__ = ["SFT", "ChatTemplateSpanError", "render_with_spans", "tokenize_chat"]


class SFT(CausalLM):
    """CLM whose labels are masked to assistant tokens. Examples: ``{"input_ids", "labels"}`` from
    :func:`tokenize_chat` (``data.build_dataset("sft", ...)`` produces them)."""

    name = "sft"
    natural_text = False  # chats: short synthetic turns, byte tokens by default
    can_pack = False
    default_seq_len = 256  # the built-in chats run to 230 byte tokens: at 128, 41 % of their answer tokens were cut

    def __init__(self, tokenizer: Any, padding_side: str = "right", template: str | None = None):
        super().__init__(tokenizer, padding_side)
        if template is not None:
            # The template belongs to the tokenizer: datasets and generation read it there, so set it once.
            tokenizer.chat_template = template
        self.template = template

    def tokenize(self, messages: Sequence[dict], max_len: int | None = None) -> dict[str, list[int]]:
        return tokenize_chat(self.tokenizer, messages, max_len, self.template)

    def collate(self, examples: list):
        ex = [e if "input_ids" in e else self.tokenize(e["messages"]) for e in examples]
        return super().collate(ex)
