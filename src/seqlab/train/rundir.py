"""What makes a directory a training run (``seqlab.runtime.rundir`` refuses such a directory or moves it aside)."""

from __future__ import annotations

import os
from pathlib import Path

from seqlab.runtime.rundir import first_existing

# What a run leaves in its directory (a cached BPE file ``bpe-*.json`` is keyed by its inputs and may be reused).
RUN_FILES = ("config.json", "metrics.jsonl", "tokenizer.json", "checkpoints")


def existing_run(out: str | os.PathLike) -> Path | None:
    """The first file or folder that shows ``out`` already holds a training run (None for a fresh folder)."""
    return first_existing(out, RUN_FILES)


def nothing_trained(out: str | os.PathLike) -> bool:
    """``out`` holds no checkpoint and no logged step: only what a run writes before its first step (its config,
    tokenizer, an empty log), which is worth nothing without a trained step and would block the same command."""
    out = Path(out)
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return False
    metrics = out / "metrics.jsonl"
    return not (metrics.is_file() and metrics.stat().st_size > 0)
