"""Training objectives: a batch of token ids -> model inputs, labels (-100 = ignore), and a token-normalised loss.

Every objective follows one contract (``objectives.base``)::

    obj = build_objective(name, tokenizer, **kwargs)  # name: a key of OBJECTIVES
    batch = obj.collate(examples)            # dict of padded tensors (move it to the device yourself)
    n = obj.num_targets(batch)               # valid targets; sum over the micro-batches (and ranks) of a step
    out = obj.loss(model, batch)             # ObjectiveOutput(loss_sum, n_targets, metrics, n_bytes)
    (out.loss_sum / step_targets).backward() # the whole step's mean; see objectives/loss.py

``obj.arch`` names the architecture it trains (decoder / encoder / encoder_decoder). Examples come from
``seqlab.data.build_dataset(obj.name, ...)``.
"""

from __future__ import annotations

import inspect
from typing import Any

from seqlab.objectives.base import BaseObjective, Objective
from seqlab.objectives.clm import CausalLM, causal_lm_loss, next_token_labels
from seqlab.objectives.dpo import DPO, dpo_loss
from seqlab.objectives.loss import IGNORE_INDEX, ObjectiveOutput, token_cross_entropy
from seqlab.objectives.mlm import MaskedLM, mask_tokens
from seqlab.objectives.seq2seq import Seq2Seq
from seqlab.objectives.sft import SFT

# The one registry: each name is spelled once, on its class; the CLI's choices and TrainConfig read it here.
OBJECTIVES: dict[str, type[BaseObjective]] = {cls.name: cls for cls in (CausalLM, MaskedLM, Seq2Seq, SFT, DPO)}


def objective_class(name: str) -> type[BaseObjective]:
    """The registered class for ``name``; an unknown name fails naming what is accepted."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def build_objective(name: str, tokenizer: Any, **kwargs: Any) -> BaseObjective:
    """An objective from the registry. Unknown names or keyword arguments fail here, naming what is accepted."""
    cls = objective_class(name)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "tokenizer")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"objective {name!r} got unknown option(s) {unknown}; it accepts {accepted}")
    return cls(tokenizer, **kwargs)


__all__ = ["BaseObjective", "CausalLM", "DPO", "IGNORE_INDEX", "MaskedLM", "OBJECTIVES", "Objective",
           "ObjectiveOutput", "SFT", "Seq2Seq", "build_objective", "causal_lm_loss", "dpo_loss", "mask_tokens",
           "next_token_labels", "objective_class", "token_cross_entropy"]
