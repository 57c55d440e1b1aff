"""Sequence-to-sequence with teacher forcing (encoder-decoder).

For a source x and target y the decoder reads the *true* prefix, not its own guesses, so all positions train in
one parallel pass::

    encoder input     x + [EOS]                      (padding masked in encoder self- and cross-attention)
    decoder input     [BOS] y_0 y_1 ... y_{n-1}       (causal + padding mask)
    labels            y_0  y_1  ...  y_{n-1} [EOS]    (-100 on padding)

The decoder input *is* the right-shifted label sequence, so there is no further shift in the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from seqlab.data.collate import pad_labels, pad_with_mask
from seqlab.objectives.base import BaseObjective
from seqlab.objectives.loss import (IGNORE_INDEX, ObjectiveOutput, count_bytes, cross_entropy_kernel,
                                    token_cross_entropy)


def teacher_forcing(target_ids: list[int], bos_id: int, eos_id: int) -> tuple[list[int], list[int]]:
    """y -> (decoder input [BOS]+y, labels y+[EOS])."""
    return [bos_id, *target_ids], [*target_ids, eos_id]


class Seq2Seq(BaseObjective):
    """Examples: ``{"source_ids": [...], "target_ids": [...]}`` (source already ends with EOS if wanted).
    Batch: ``input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels``."""

    name = "seq2seq"
    arch = "encoder_decoder"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        if tokenizer.bos_id is None or tokenizer.eos_id is None:
            raise ValueError(f"seq2seq needs BOS and EOS tokens; tokenizer {tokenizer.name!r} lacks one")
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id

    def collate(self, examples: list) -> dict[str, Tensor]:
        src = [list(e["source_ids"]) for e in examples]
        dec, lab = zip(*(teacher_forcing(list(e["target_ids"]), self.bos_id, self.eos_id) for e in examples))
        input_ids, attention_mask = pad_with_mask(src, self.pad_id)
        decoder_input_ids, decoder_attention_mask = pad_with_mask(dec, self.pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids,
                "decoder_attention_mask": decoder_attention_mask, "labels": pad_labels(lab)}

    def num_targets(self, batch: dict[str, Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> ObjectiveOutput:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=batch["decoder_input_ids"],
                       decoder_attention_mask=batch["decoder_attention_mask"])
        loss_sum, n = token_cross_entropy(logits, batch["labels"], cross_entropy_kernel(model))
        with torch.no_grad():
            valid = batch["labels"] != IGNORE_INDEX
            correct = (logits.argmax(-1) == batch["labels"]) | ~valid
            token_acc = float(((logits.argmax(-1) == batch["labels"]) & valid).sum()) / max(n, 1)
            seq_acc = float(correct.all(-1).float().mean())
        return ObjectiveOutput(loss_sum, n, {"loss": float(loss_sum.detach()) / max(n, 1), "token_accuracy": token_acc,
                                             "sequence_accuracy": seq_acc},
                               count_bytes(batch["labels"], self.byte_table),
                               {"sequence_accuracy": len(valid)})  # a mean over rows, not targets
