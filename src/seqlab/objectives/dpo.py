"""Direct preference optimisation (DPO, Rafailov et al. 2023).

For a prompt x with a preferred response y_c and a dispreferred y_r, let pi(y|x) be the policy's and ref(y|x) a
frozen reference's *summed* response-token log-probabilities. The loss is

    -log sigmoid( beta * ((pi_c - pi_r) - (ref_c - ref_r)) )

i.e. raise the chosen response's likelihood relative to the rejected one, measured against where the reference
already stood, with beta setting how far the policy may drift. The implicit rewards beta*(pi - ref) give the
reported ``reward_margin`` (chosen minus rejected) and ``accuracy`` (fraction of pairs with chosen > rejected).

Layout: chosen and rejected rows are concatenated into one batch of 2B rows (one forward pass; rows 0..B-1 chosen,
B..2B-1 rejected); labels are -100 on the prompt and padding, so the next-token log-probs summed per row are
exactly the response's. Normalisation is per *pair*: ``n_targets`` is the number of pairs.

The reference is a frozen copy of the policy taken by ``setup(model)`` (the trainer calls it before any resume
checkpoint is loaded, so the reference is the initial policy); if nobody called it, the first ``loss`` call does.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seqlab.data.collate import pad_labels, pad_with_mask
from seqlab.data.chat import tokenize_preference
from seqlab.objectives.base import BaseObjective
from seqlab.objectives.clm import next_token_labels
from seqlab.objectives.loss import IGNORE_INDEX, ObjectiveOutput, sequence_logprobs


def dpo_loss(pi_chosen: Tensor, pi_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair (losses, chosen rewards, rejected rewards) from summed log-probs."""
    logits = beta * ((pi_chosen - pi_rejected) - (ref_chosen - ref_rejected))
    return -F.logsigmoid(logits), beta * (pi_chosen - ref_chosen).detach(), beta * (pi_rejected - ref_rejected).detach()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / compile wrappers
        model = model.module
    return getattr(model, "_orig_mod", model)


class DPO(BaseObjective):
    """Examples: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (see :meth:`tokenize`), or raw
    ``{"prompt", "chosen", "rejected"}`` which are tokenised on the fly. Batch: ``input_ids, attention_mask,
    labels`` of 2B rows."""

    name = "dpo"
    arch = "decoder"
    token_level = False  # a per-pair preference loss: perplexity and bits per byte mean nothing
    uses_initial_model = True  # setup() snapshots the initial policy as the frozen reference
    loss_label = "DPO loss (-log sigmoid(beta * reward margin), per pair)"

    def __init__(self, tokenizer: Any, beta: float = 0.1, reference: torch.nn.Module | None = None,
                 max_len: int | None = None, template: str | None = None):
        super().__init__(tokenizer)
        self.check_options({"beta": beta, "max_len": max_len})
        self.beta, self.max_len, self.template = beta, max_len, template
        if template is not None:
            tokenizer.chat_template = template  # as in SFT: datasets tokenise with the tokenizer's template
        self.reference = None
        if reference is not None:
            self.set_reference(reference)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """``beta`` positive and finite (it scales the margin inside the sigmoid), ``max_len`` None or positive."""
        beta, max_len = options["beta"], options["max_len"]
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"objective 'dpo': option beta={beta!r} must be a positive finite number")
        if max_len is not None and max_len < 1:
            raise ValueError(f"objective 'dpo': option max_len={max_len!r} must be a positive integer or null")

    # --- reference -------------------------------------------------------------------------------------------
    def set_reference(self, model: torch.nn.Module) -> None:
        """Freeze a copy of ``model`` as the reference, and turn the policy's dropout off.

        Why no dropout: the implicit rewards compare the policy with the reference, which scores in eval mode; with
        dropout on in the policy, its noise swamps the rewards (at policy = reference the loss read 0.699, not
        log 2). The DPO paper's code and TRL's ``disable_dropout`` train without it too.
        """
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
            if isinstance(getattr(m, "attn_dropout", None), float):
                m.attn_dropout = 0.0
        ref = copy.deepcopy(_unwrap(model))
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        self.reference = ref

    def setup(self, model: torch.nn.Module) -> None:
        self.set_reference(model)

    # --- data ------------------------------------------------------------------------------------------------
    def tokenize(self, example: dict[str, Any], max_len: int | None = None) -> dict[str, list[int]]:
        return tokenize_preference(self.tokenizer, example, max_len or self.max_len, self.template)

    def collate(self, examples: list) -> dict[str, Tensor]:
        ex = [e if "prompt_ids" in e else self.tokenize(e) for e in examples]
        rows, labels = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for e in ex:
                p, r = list(e["prompt_ids"]), list(e[key])
                rows.append(p + r)
                labels.append([IGNORE_INDEX] * len(p) + r)
        input_ids, attention_mask = pad_with_mask(rows, self.pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": pad_labels(labels)}

    def num_targets(self, batch: dict[str, Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    # --- loss ------------------------------------------------------------------------------------------------
    def _logps(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        targets = next_token_labels(batch["labels"], attention_mask=batch["attention_mask"])
        return sequence_logprobs(logits[:, :-1], targets)

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> ObjectiveOutput:
        if self.reference is None:
            self.set_reference(model)
        device = batch["input_ids"].device
        if next(self.reference.parameters()).device != device:
            self.reference.to(device)
        logps = self._logps(model, batch)
        with torch.no_grad():
            ref = self._logps(self.reference, batch)
        B = logps.shape[0] // 2
        losses, r_c, r_r = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], self.beta)
        margin = r_c - r_r
        metrics = {
            "loss": float(losses.detach().mean()),
            "reward_margin": float(margin.mean()),
            "accuracy": float((margin > 0).float().mean()),
            "reward_chosen": float(r_c.mean()),
            "reward_rejected": float(r_r.mean()),
            "logp_chosen": float(logps[:B].detach().mean()),
            "logp_rejected": float(logps[B:].detach().mean()),
        }
        return ObjectiveOutput(losses.sum(), B, metrics)
