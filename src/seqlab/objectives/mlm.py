"""Masked language modelling (BERT): hide some tokens, predict them from both sides.

Of the *eligible* tokens (not PAD, not any special token) each is picked with probability ``mask_prob`` (15 %).
A picked token becomes [MASK] with probability 80 %, a random non-special token with 10 %, and stays unchanged
with 10 % (so the model cannot assume "a visible token is never a target"). Only picked positions are scored.

Masks are drawn at collate time (dynamic masking: a new mask every time an example is seen) from a generator
seeded with ``(seed, number of batches collated so far, rank)``; that counter is the objective's ``state_dict`` so a
resumed run draws the same masks as an uninterrupted one. The rank (under ``torchrun``) keeps two ranks from masking
the same positions of their batches. Evaluation masks come from their own stream, keyed by the batch's index in
the pass and not by the rank, so a validation loss does not depend on how many processes computed it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from seqlab.data.collate import pad_with_mask
from seqlab.objectives.base import BaseObjective
from seqlab.objectives.loss import (IGNORE_INDEX, ObjectiveOutput, count_bytes, cross_entropy_kernel,
                                    token_cross_entropy)

# Decision codes returned by mask_tokens (for tests and diagnostics).
KEEP, MASKED, RANDOM, UNCHANGED = 0, 1, 2, 3


def mask_tokens(input_ids: Tensor, eligible: Tensor, mask_id: int, random_pool: Tensor, generator: torch.Generator,
                mask_prob: float = 0.15, mask_frac: float = 0.8, random_frac: float = 0.1
                ) -> tuple[Tensor, Tensor, Tensor]:
    """-> (corrupted ids, labels with -100 except at picked positions, decision codes)."""
    shape = input_ids.shape
    picked = (torch.rand(shape, generator=generator) < mask_prob) & eligible
    u = torch.rand(shape, generator=generator)
    to_mask = picked & (u < mask_frac)
    to_random = picked & (u >= mask_frac) & (u < mask_frac + random_frac)
    rand_tokens = random_pool[torch.randint(len(random_pool), shape, generator=generator)]
    out = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    out = torch.where(to_random, rand_tokens, out)
    labels = input_ids.masked_fill(~picked, IGNORE_INDEX)
    decision = torch.full_like(input_ids, KEEP)
    decision[picked] = UNCHANGED
    decision[to_mask] = MASKED
    decision[to_random] = RANDOM
    return out, labels, decision


class MaskedLM(BaseObjective):
    """Examples: lists of token ids (include BOS/EOS if you want them; specials are never picked).
    Batch: ``input_ids`` (corrupted), ``attention_mask``, ``labels``. Trains an ``encoder``."""

    name = "mlm"
    arch = "encoder"
    natural_text = True

    def __init__(self, tokenizer: Any, mask_prob: float = 0.15, mask_frac: float = 0.8, random_frac: float = 0.1,
                 seed: int = 0):
        super().__init__(tokenizer)
        if tokenizer.mask_id is None:
            raise ValueError(f"MLM needs a [MASK] token; tokenizer {tokenizer.name!r} has none")
        self.check_options({"mask_prob": mask_prob, "mask_frac": mask_frac, "random_frac": random_frac})
        self.mask_prob, self.mask_frac, self.random_frac = mask_prob, mask_frac, random_frac
        self.seed = seed
        self.calls = 0
        self._evaluating = False
        specials = set(tokenizer.special_ids) | ({tokenizer.pad_id} if tokenizer.pad_id is not None else set())
        self.special = torch.tensor(sorted(specials), dtype=torch.long)
        self.random_pool = torch.tensor([i for i in range(tokenizer.vocab_size) if i not in specials], dtype=torch.long)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """The rates are probabilities: ``mask_prob`` in (0, 1] (0 would leave no target), the two others >= 0
        and together at most 1 (the rest of the picked tokens stays unchanged)."""
        prob, frac, rand = options["mask_prob"], options["mask_frac"], options["random_frac"]
        if not 0.0 < prob <= 1.0:
            raise ValueError(f"objective 'mlm': option mask_prob={prob!r} must be in (0, 1]")
        for key, value in (("mask_frac", frac), ("random_frac", rand)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"objective 'mlm': option {key}={value!r} must be in [0, 1]")
        if frac + rand > 1.0:
            raise ValueError(f"objective 'mlm': options mask_frac={frac!r} and random_frac={rand!r} must add up to "
                             "at most 1")

    def _generator(self) -> torch.Generator:
        rank = 0 if self._evaluating or not (dist.is_available() and dist.is_initialized()) else dist.get_rank()
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + self.calls + rank * 0x9E3779B1) % (2**63))
        self.calls += 1
        return g

    def collate(self, examples: list, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        seqs = [list(e["input_ids"] if isinstance(e, dict) else e) for e in examples]
        ids, attention_mask = pad_with_mask(seqs, self.pad_id)
        eligible = (attention_mask == 1) & ~torch.isin(ids, self.special)
        corrupted, labels, _ = mask_tokens(ids, eligible, self.tokenizer.mask_id, self.random_pool,
                                           generator or self._generator(), self.mask_prob, self.mask_frac,
                                           self.random_frac)
        return {"input_ids": corrupted, "attention_mask": attention_mask, "labels": labels}

    def num_targets(self, batch: dict[str, Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> ObjectiveOutput:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        loss_sum, n = token_cross_entropy(logits, batch["labels"], cross_entropy_kernel(model))
        return ObjectiveOutput(loss_sum, n, {"loss": float(loss_sum.detach()) / max(n, 1)},
                               count_bytes(batch["labels"], self.byte_table))

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Evaluation masks: a separate, restarting RNG stream, so every evaluation scores the same positions and
        the training stream continues as if no evaluation had happened."""
        saved_calls, saved_seed = self.calls, self.seed
        self.calls, self.seed, self._evaluating = 0, self.seed + 0x5EED, True
        try:
            yield
        finally:
            self.calls, self.seed, self._evaluating = saved_calls, saved_seed, False

    def at_batch(self, index: int) -> None:
        if self._evaluating:
            self.calls = index

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))
