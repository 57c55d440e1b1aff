"""One run per directory: a new run never writes into an earlier one.

Mixing two runs loses data in quiet ways: the new run's metrics replace the old ones while the old checkpoints
stay, ``keep_last`` then prunes the new run's checkpoints (the old step numbers are higher) and ``seqlab eval``
scores the old run. So a directory that holds a run is refused unless the caller resumes it or asks to move it
aside.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from seqlab.runtime.files import ensure_writable_dir

# What a run leaves in its directory (a cached BPE file ``bpe-*.json`` is keyed by its inputs and may be reused).
RUN_FILES = ("config.json", "metrics.jsonl", "tokenizer.json", "checkpoints")


class RunDirectoryInUse(ValueError):
    """The output directory already holds a run and neither --resume nor --overwrite was given."""


def holds_run(out: Path) -> bool:
    return out.is_dir() and any((out / name).exists() for name in RUN_FILES)


def claim_run_dir(out: str | os.PathLike, overwrite: bool = False) -> Path | None:
    """Make ``out`` a usable, empty-of-runs directory for a new run; returns where an old run was moved, if any.

    A run already there is refused (``RunDirectoryInUse``), or, with ``overwrite``, renamed to
    ``<out>.old-<UTC time>`` so nothing is deleted."""
    out = Path(out)
    moved = None
    if holds_run(out):
        if not overwrite:
            raise RunDirectoryInUse(f"--out {out}: already holds a run; use --resume to continue it, or --overwrite "
                                    "to move it aside and start a new one")
        moved = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        n = 1
        while moved.exists():
            moved, n = moved.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{n}"), n + 1
        os.rename(out, moved)
    ensure_writable_dir(out, "--out")
    return moved
