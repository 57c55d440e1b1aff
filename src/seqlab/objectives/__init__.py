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
import typing
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


def _option_types(cls: type[BaseObjective]) -> dict[str, tuple[type, ...]]:
    """Each keyword option of ``cls.__init__`` -> the types its annotation allows (``float | None`` -> float, None)."""
    hints = typing.get_type_hints(cls.__init__)
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "tokenizer")]
    return {p: tuple(type(None) if a is None else a for a in (typing.get_args(hints[p]) or (hints[p],)))
            for p in params}


_TYPE_WORDS = {float: "a number", int: "an integer", str: "a string", bool: "true or false", type(None): "null"}


def _fits(value: Any, kind: type) -> bool:
    """``isinstance`` as JSON values mean it: a float option takes an int, no number option takes a bool."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_objective_options(name: str, options: dict[str, Any]) -> None:
    """Refuse an unknown option, or a value of the wrong type or range, naming the option.

    Why here and not in the constructor alone: the CLI checks ``--objective-arg`` while validating the TrainConfig,
    before a tokenizer exists and before anything is written, so a typo never leaves a half-made run folder behind
    (and a TypeError deep inside a loss never reaches the user). The constructors run the same range checks.
    """
    cls = objective_class(name)
    types = _option_types(cls)
    unknown = sorted(set(options) - set(types))
    if unknown:
        raise ValueError(f"objective {name!r} got unknown option(s) {unknown}; it accepts {list(types)}")
    for key, value in options.items():
        if not any(_fits(value, kind) for kind in types[key]):
            expected = " or ".join(_TYPE_WORDS.get(k, f"a {k.__name__} object") for k in types[key])
            raise ValueError(f"objective {name!r}: option {key}={value!r} must be {expected}")
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k in types}
    cls.check_options(defaults | options)


def build_objective(name: str, tokenizer: Any, **kwargs: Any) -> BaseObjective:
    """An objective from the registry. Unknown names, options or bad option values fail here, naming them."""
    check_objective_options(name, kwargs)
    return objective_class(name)(tokenizer, **kwargs)


__all__ = ["BaseObjective", "CausalLM", "DPO", "IGNORE_INDEX", "MaskedLM", "OBJECTIVES", "Objective",
           "ObjectiveOutput", "SFT", "Seq2Seq", "build_objective", "causal_lm_loss", "check_objective_options",
           "dpo_loss", "mask_tokens", "next_token_labels", "objective_class", "token_cross_entropy"]
