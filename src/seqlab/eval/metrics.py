"""Perplexity and bits per byte, computed from sums so batches and ranks combine exactly.

Perplexity exp(mean token NLL) depends on the tokenizer (a BPE token carries ~3 bytes, a byte token one), so it
does not compare across tokenizers; bits per byte does: total NLL in bits divided by the UTF-8 bytes of the scored
text. The byte count comes from the tokenizer's per-token byte lengths (``Tokenizer.byte_lengths``), so it is
exactly the bytes the scored targets spell, whatever the tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

LN2 = math.log(2.0)


def perplexity(loss_sum: float, n_tokens: int) -> float:
    """exp(mean NLL in nats); inf if the mean overflows."""
    mean = loss_sum / max(n_tokens, 1)
    return math.exp(mean) if mean < 700 else float("inf")


def bits_per_token(loss_sum: float, n_tokens: int) -> float:
    return loss_sum / (max(n_tokens, 1) * LN2)


def bits_per_byte(loss_sum: float, n_bytes: int) -> float:
    """Total NLL (nats) -> bits per UTF-8 byte of the scored text."""
    return loss_sum / (max(n_bytes, 1) * LN2)


@dataclass
class EvalTotals:
    """Running sums over batches: add ObjectiveOutputs, then read the metrics."""

    loss_sum: float = 0.0
    n_targets: int = 0
    n_bytes: int = 0
    has_bytes: bool = True

    def add(self, out: Any) -> None:
        self.loss_sum += float(out.loss_sum.detach())
        self.n_targets += int(out.n_targets)
        if out.n_bytes is None:
            self.has_bytes = False
        else:
            self.n_bytes += int(out.n_bytes)

    def merge(self, other: "EvalTotals") -> None:
        self.loss_sum += other.loss_sum
        self.n_targets += other.n_targets
        self.n_bytes += other.n_bytes
        self.has_bytes &= other.has_bytes

    def as_dict(self) -> dict[str, float]:
        d = {"loss": self.loss_sum / max(self.n_targets, 1), "perplexity": perplexity(self.loss_sum, self.n_targets),
             "bits_per_token": bits_per_token(self.loss_sum, self.n_targets), "n_targets": self.n_targets}
        if self.has_bytes and self.n_bytes > 0:
            d["bits_per_byte"] = bits_per_byte(self.loss_sum, self.n_bytes)
            d["n_bytes"] = self.n_bytes
        return d


@torch.no_grad()
def evaluate(model: torch.nn.Module, objective: Any, batches: Iterable[dict[str, torch.Tensor]],
             device: torch.device | str | None = None, max_batches: int | None = None) -> dict[str, float]:
    """Loss, perplexity and bits per byte of ``model`` over collated ``batches`` (eval mode, no grad).

    Metrics are the exact pooled values (sum of NLL / sum of targets), not a mean of per-batch means.
    """
    was_training = model.training
    model.eval()
    totals = EvalTotals()
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            if device is not None:
                batch = {k: v.to(device) for k, v in batch.items()}
            totals.add(objective.loss(model, batch))
    finally:
        model.train(was_training)
    return totals.as_dict()
