"""Checks that keep a run from writing something wrong: non-finite weights, and a resume that changes the run.

Why a module of its own: each check is a few lines, but each guards a promise the Trainer makes in its messages
("the last good checkpoint is ...", "resumed exactly"), so they are kept together, small and tested one by one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from seqlab.runtime.errors import CheckpointError
from seqlab.train.config import RESUME_MUTABLE, TrainConfig, same_setting
from seqlab.train.schedule import LRSchedule


def non_finite_parameter(model: nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or an infinity, None when all are finite.

    Under FSDP each rank sees its own shard (``to_local``): the caller agrees over ranks. One device sync for the
    whole model (the per-tensor flags are stacked), so it is cheap enough to run at every checkpoint.
    """
    named = [(name, p.to_local() if hasattr(p, "to_local") else p) for name, p in model.named_parameters()]
    named = [(name, t) for name, t in named if t.numel() > 0]
    if not named:
        return None
    with torch.no_grad():
        finite = torch.stack([torch.isfinite(t).all() for _, t in named])
        if bool(finite.all()):
            return None
        return named[int((~finite).nonzero()[0])][0]


def check_unchanged(path: str | os.PathLike, old: dict[str, Any], new: dict[str, Any],
                    frozen: frozenset[str] = frozenset()) -> None:
    """Refuse a resume whose configuration differs from the checkpoint's in a field outside ``RESUME_MUTABLE``, or
    in one of ``frozen`` (fields this run depends on although others may change them: DPO's ``init``, its
    reference), naming every such field with its old and new value."""
    mutable = RESUME_MUTABLE - frozen
    diffs = sorted(k for k in new if k not in mutable and k in old and not same_setting(k, old[k], new[k]))
    if diffs:
        detail = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in diffs)
        raise CheckpointError(f"{path}: cannot resume, the run configuration changed ({detail})")


def check_resume_steps(path: str | os.PathLike, old: dict[str, Any], cfg: TrainConfig, step: int,
                       train_seconds: float) -> str | None:
    """Refuse a ``max_steps`` below the checkpoint's step; for a changed one, the warning to print (else None).

    Why: a resume past ``max_steps`` would train nothing yet rewrite ``config.json`` with the smaller number;
    and the schedule is a function of ``step / max_steps``, so a new ``max_steps`` moves the learning rate of the
    very next update (a jump the loss curve shows without saying why). The warning gives both values.
    """
    if cfg.max_steps < step:  # equal: a finished run resumed (a retry, a restart) finishes again, training nothing
        raise CheckpointError(f"{path}: --max-steps {cfg.max_steps} is below the checkpoint's step {step}; give "
                              f"--max-steps above {step} to continue the run")
    old_max = old.get("max_steps")
    if old_max is None or old_max == cfg.max_steps or cfg.max_steps == step:
        return None
    before = LRSchedule(cfg.replace(max_steps=old_max))(step, train_seconds)
    after = LRSchedule(cfg)(step, train_seconds)
    if before == after:  # a constant schedule, or one bound by --max-time: nothing moves
        return None
    return (f"--max-steps {cfg.max_steps} (the run had {old_max}) re-stretches the learning-rate schedule: the LR at "
            f"the resumed step {step} changes from {before:.4g} to {after:.4g}")


def trainer_state(path: str | os.PathLike, state: dict[str, Any]) -> dict[str, Any]:
    """The ``trainer`` record of a checkpoint's state.json, its fields checked, else a CheckpointError naming the
    file. Why: the state's own sha256 catches damage, but a checkpoint written before it was recorded has none, and
    a missing or mistyped field then surfaced as a KeyError traceback mid-resume."""
    where = Path(path) / "state.json"
    tr = state.get("trainer")
    if not isinstance(tr, dict):
        raise CheckpointError(f"{where}: no trainer record (step, tokens seen, data position); not a training "
                              "checkpoint, or a damaged one")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    for key, ok in (("step", count), ("tokens_seen", count),
                    ("train_seconds", lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0),
                    ("sampler", lambda v: isinstance(v, dict))):
        if not ok(tr.get(key)):
            raise CheckpointError(f"{where}: trainer.{key} is {tr.get(key)!r}, which no checkpoint writes; the file "
                                  "is damaged")
    if not isinstance(state.get("train_config", {}), dict):
        raise CheckpointError(f"{where}: train_config is not an object; the file is damaged")
    return tr
