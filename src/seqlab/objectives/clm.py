"""Causal language modelling: position i is scored on token i+1.

**Callers pass unshifted ids.** ``labels`` has the same layout as ``input_ids`` (-100 where a token must not be
learned: padding, prompts in SFT); :func:`next_token_labels` is the one and only place where labels are shifted,
and SFT and DPO reuse it. (Shifting twice, or not at all, silently trains a different task: with a causal mask and
unshifted labels the model learns to copy its input.)

With packed rows (``document_ids``), the target that would cross into the next document is dropped too, so a packed
batch scores exactly the targets of the same documents one per row.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from seqlab.data.collate import PADDING_SIDES, pad_labels, pad_sequences, pad_with_mask
from seqlab.objectives.base import BaseObjective
from seqlab.objectives.loss import (IGNORE_INDEX, ObjectiveOutput, count_bytes, cross_entropy_kernel,
                                    token_cross_entropy)


def next_token_labels(labels: Tensor, document_ids: Tensor | None = None,
                      attention_mask: Tensor | None = None) -> Tensor:
    """[B, T] unshifted labels -> [B, T-1] targets for logits[:, :-1]: target_i = labels_{i+1}.

    A target is dropped when the position that would predict it is padding (the first real token of a
    left-padded row has no context, exactly as position 0 of an unpadded row) or belongs to another document.
    """
    targets = labels[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, :-1] == 0, IGNORE_INDEX)
    if document_ids is not None:
        same = document_ids[:, 1:] == document_ids[:, :-1]
        targets = targets.masked_fill(~same, IGNORE_INDEX)
    return targets


def causal_lm_loss(logits: Tensor, labels: Tensor, document_ids: Tensor | None = None,
                   attention_mask: Tensor | None = None) -> tuple[Tensor, int]:
    """(sum of next-token CE, number of targets) for logits [B, T, V] and unshifted labels [B, T]."""
    return token_cross_entropy(logits, _pad_last(next_token_labels(labels, document_ids, attention_mask)))


def _pad_last(targets: Tensor) -> Tensor:
    """[B, T-1] targets -> [B, T] with nothing to predict at the last position, so the CE can read the logits
    tensor as it is (slicing logits[:, :-1] would force a copy of the largest activation of the step)."""
    return F.pad(targets, (0, 1), value=IGNORE_INDEX)


def _as_example(e: Any) -> dict[str, Sequence[int]]:
    return {"input_ids": e} if not isinstance(e, dict) else e


class CausalLM(BaseObjective):
    """Examples: a list of token ids, or ``{"input_ids", optional "labels", optional "document_ids"}`` (packed rows,
    all of one length). Batch: ``input_ids, attention_mask, labels`` (+ ``document_ids``)."""

    name = "clm"
    arch = "decoder"
    natural_text = True
    can_pack = True

    def __init__(self, tokenizer: Any, padding_side: str = "right"):
        super().__init__(tokenizer)
        self.check_options({"padding_side": padding_side})
        self.padding_side = padding_side
        # A BOS that opens a document (after the last one's EOS) is no skill to predict, and --pack and perplexity
        # never score it; a BOS inside a text (SmolLM2's is ChatML's <|im_start|>) is an ordinary target. Where BOS
        # is EOS (GPT-2's <|endoftext|>), the token is kept: the model must learn to stop.
        bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
        self.unscored = bos if bos is not None and bos != eos else None
        self.eos_id = eos

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """``padding_side`` is one of ``PADDING_SIDES`` (found otherwise only at the first collate, mid-run)."""
        if options["padding_side"] not in PADDING_SIDES:
            raise ValueError(f"objective {cls.name!r}: option padding_side={options['padding_side']!r} must be one "
                             f"of {list(PADDING_SIDES)}")

    def collate(self, examples: list) -> dict[str, Tensor]:
        ex = [_as_example(e) for e in examples]
        seqs = [list(e["input_ids"]) for e in ex]
        input_ids, attention_mask = pad_with_mask(seqs, self.pad_id, self.padding_side)
        if any("labels" in e for e in ex):
            labels = pad_labels([list(e.get("labels", e["input_ids"])) for e in ex], self.padding_side)
        else:  # plain text: every token is a target but padding and BOS (labels given, as SFT's, are kept as given)
            labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
            if self.unscored is not None:
                labels.masked_fill_(self._document_openers(input_ids, attention_mask), IGNORE_INDEX)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if any("document_ids" in e for e in ex):
            batch["document_ids"] = pad_sequences([list(e["document_ids"]) for e in ex], -1, self.padding_side)
            labels.masked_fill_(batch["document_ids"] < 0, IGNORE_INDEX)
        return batch

    def _document_openers(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Where a BOS opens a document: after an EOS or padding (with no EOS in the vocabulary, every BOS)."""
        opens = input_ids == self.unscored
        if self.eos_id is not None:
            after_end = torch.ones_like(opens)
            after_end[:, 1:] = (input_ids[:, :-1] == self.eos_id) | (attention_mask[:, :-1] == 0)
            opens &= after_end
        return opens

    def num_targets(self, batch: dict[str, Tensor]) -> int:
        return int((self.targets(batch) != IGNORE_INDEX).sum())

    def targets(self, batch: dict[str, Tensor]) -> Tensor:
        """[B, T-1] next-token targets of a collated batch."""
        return next_token_labels(batch["labels"], batch.get("document_ids"), batch.get("attention_mask"))

    def forward(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        if "document_ids" in batch:
            return model(batch["input_ids"], document_ids=batch["document_ids"])
        return model(batch["input_ids"], attention_mask=batch["attention_mask"])

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> ObjectiveOutput:
        logits = self.forward(model, batch)
        targets = self.targets(batch)
        loss_sum, n = token_cross_entropy(logits, _pad_last(targets), cross_entropy_kernel(model))
        return ObjectiveOutput(loss_sum, n, {"loss": float(loss_sum.detach()) / max(n, 1)},
                               count_bytes(targets, self.byte_table))
