"""Perplexity and bits per byte, computed from sums so batches and ranks combine exactly.

Perplexity depends on the tokenizer (a BPE token carries several bytes, a byte token one), so it does not compare
across tokenizers; bits per byte does: total NLL in bits over the UTF-8 bytes the scored targets spell.

The Trainer's periodic evaluation and ``seqlab eval`` both pool through :class:`EvalTotals`, so they report one
answer. Perplexity is ``exp(mean NLL)`` exactly, and ``inf`` when that overflows a float: a cap would print a
finite number that is not the perplexity (``metrics.jsonl`` stores it as null, JSON having no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from seqlab.objectives.loss import count_bytes
from seqlab.runtime.progress import progress

LN2 = math.log(2.0)


def perplexity(loss_sum: float, n_tokens: int) -> float:
    """exp(mean NLL in nats); inf when it overflows a float."""
    mean = loss_sum / max(n_tokens, 1)
    return math.exp(mean) if mean < 700 else float("inf")


def bits_per_token(loss_sum: float, n_tokens: int) -> float:
    return loss_sum / (max(n_tokens, 1) * LN2)


def bits_per_byte(loss_sum: float, n_bytes: int) -> float:
    """Total NLL (nats) -> bits per UTF-8 byte of the scored text."""
    return loss_sum / (max(n_bytes, 1) * LN2)


def scored_bytes(out: Any, batch: dict[str, Any], byte_table: torch.Tensor | None) -> int | None:
    """Bytes behind a batch's targets: the objective's own count, else counted from its aligned ``labels``."""
    if out.n_bytes is not None:
        return int(out.n_bytes)
    labels = batch.get("labels")
    return count_bytes(labels, byte_table) if isinstance(labels, torch.Tensor) else None


@dataclass
class EvalTotals:
    """Running sums over batches (and, via ``as_tensor``/``from_tensor``, over ranks); then read the metrics."""

    loss_sum: float = 0.0
    n_targets: int = 0
    n_bytes: int = 0
    has_bytes: bool = True

    def add(self, out: Any, batch: dict[str, Any] | None = None, byte_table: torch.Tensor | None = None) -> None:
        self.loss_sum += float(out.loss_sum.detach())
        self.n_targets += int(out.n_targets)
        n_bytes = scored_bytes(out, batch or {}, byte_table)
        if n_bytes is None:
            self.has_bytes = False
        else:
            self.n_bytes += n_bytes

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([self.loss_sum, self.n_targets, self.n_bytes, float(self.has_bytes)],
                            dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, n_ranks: int = 1) -> EvalTotals:
        """Totals from a summed ``as_tensor`` (``has_bytes`` only if every one of ``n_ranks`` had bytes)."""
        loss_sum, n, n_bytes, has = (float(x) for x in t.cpu())
        return cls(loss_sum, int(n), int(n_bytes), has >= n_ranks)

    def as_dict(self, token_level: bool = True) -> dict[str, float]:
        """``token_level=False`` (a per-pair preference loss): loss and count only; perplexity means nothing."""
        d: dict[str, float] = {"loss": self.loss_sum / max(self.n_targets, 1), "n_targets": self.n_targets}
        if not token_level:
            return d
        d.update(perplexity=perplexity(self.loss_sum, self.n_targets),
                 bits_per_token=bits_per_token(self.loss_sum, self.n_targets))
        if self.has_bytes and self.n_bytes > 0:
            d["bits_per_byte"] = bits_per_byte(self.loss_sum, self.n_bytes)
            d["n_bytes"] = self.n_bytes
        return d


@torch.no_grad()
def evaluate(model: torch.nn.Module, objective: Any, batches: Iterable[dict[str, torch.Tensor]],
             device: torch.device | str | None = None, max_batches: int | None = None, total: int | None = None,
             show_progress: bool = False) -> dict[str, float]:
    """Loss, perplexity and bits per byte of ``model`` over collated ``batches`` (eval mode, no grad).

    Metrics are the exact pooled values (sum of NLL / sum of targets), not a mean of per-batch means.
    """
    was_training = model.training
    model.eval()
    totals = EvalTotals()
    byte_table = getattr(objective, "byte_table", None)
    if max_batches is not None and total is not None:
        total = min(total, max_batches)
    bar = progress(total=total, desc="eval", unit="batch", enabled=show_progress)
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            if device is not None:
                batch = {k: v.to(device) for k, v in batch.items()}
            totals.add(objective.loss(model, batch), batch, byte_table)
            bar.update(1)
    finally:
        bar.close()
        model.train(was_training)
    return totals.as_dict(getattr(objective, "token_level", True))
