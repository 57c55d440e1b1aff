"""One run per directory: a new run never writes into an earlier one.

Mixing two runs loses data in quiet ways: the new run's metrics replace the old ones while the old checkpoints
stay, ``keep_last`` then prunes the new run's checkpoints (the old step numbers are higher) and ``seqlab eval``
scores the old run. So a directory that holds a run is refused unless the caller resumes it or asks to move it
aside. Each driver (Trainer, VMC) says what makes a folder one of its runs; refusing and moving live here, once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from seqlab.runtime.files import ensure_writable_dir


class RunDirectoryInUse(ValueError):
    """The output directory already holds a run and neither --resume nor --overwrite was given."""


def first_existing(out: str | os.PathLike, names: Iterable[str]) -> Path | None:
    """The first of ``names`` present in ``out`` (the evidence that it holds a run), or None."""
    return next((Path(out) / name for name in names if (Path(out) / name).exists()), None)


def refuse_run(out: str | os.PathLike, found: Path | None) -> None:
    """Raise ``RunDirectoryInUse`` when ``found`` (what shows ``out`` holds a run) is not None."""
    if found is not None:
        raise RunDirectoryInUse(f"--out {out}: already holds a run ({found}); use --resume to continue it, or "
                                "--overwrite to move it aside and start a new one")


def move_aside(out: str | os.PathLike) -> Path:
    """Rename ``out`` to ``<out>.old-<UTC time>`` (``-1``, ``-2``... when taken); nothing is deleted."""
    out = Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved, n = out.with_name(f"{out.name}.old-{stamp}"), 1
    while moved.exists():
        moved, n = out.with_name(f"{out.name}.old-{stamp}-{n}"), n + 1
    os.rename(out, moved)
    return moved


@contextlib.contextmanager
def removed_if_left_empty(out: str | os.PathLike,
                          disposable: Callable[[Path], bool] | None = None) -> Iterator[None]:
    """A folder the command creates is taken away again if the command fails with nothing written into it (a
    malformed data line found after ``--out`` was made), so no empty run folder is left to puzzle over. Only an
    empty folder goes (``rmdir`` refuses any other), or one that ``disposable`` says holds nothing worth keeping
    (a training run that failed at its first step: its config and tokenizer, no checkpoint). A folder that existed
    before the command is never removed."""
    existed = Path(out).exists()
    try:
        yield
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                if disposable is not None and Path(out).is_dir() and disposable(Path(out)):
                    shutil.rmtree(out)
                else:
                    Path(out).rmdir()
        raise


def claim_run_dir(out: str | os.PathLike, found: Path | None, overwrite: bool = False) -> Path | None:
    """Make ``out`` a writable directory free of runs for a new run; returns where an old run was moved, if any.

    ``found`` is what shows a run is already there (None: nothing). Such a run is refused
    (``RunDirectoryInUse``), or, with ``overwrite``, moved aside whole."""
    moved = None
    if found is not None:
        if not overwrite:
            refuse_run(out, found)
        moved = move_aside(out)
    ensure_writable_dir(out, "--out")
    return moved
