"""The metrics log of a run: one JSON object per line, an optional TensorBoard mirror, and a curve plot.

Plots use a bare ``Figure`` (no pyplot), so no window or GUI backend is ever involved.

Lines are appended and flushed one at a time, so a crash loses at most the line being written. A resumed run
drops the lines after its checkpoint's step, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seqlab.runtime.files import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Reference levels (HF, CCSD(T), FCI, a target loss...): a colour and a dash each, none of them the colours of the
# curves (matplotlib's first two, tab:blue and tab:orange, and tab:green on the right axis).
REFERENCE_COLORS = ("black", "tab:red", "tab:purple", "tab:brown", "tab:gray", "tab:olive", "tab:cyan", "tab:pink")
REFERENCE_DASHES = ("--", ":", "-.")


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete JSON object in ``path``; a torn last line from a crash, or a damaged one, is skipped."""
    rows = []
    if not Path(path).is_file():
        return rows
    for line in Path(path).read_bytes().splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class Logbook:
    """``metrics.jsonl`` of one run. ``resume_step=None`` starts a new log; otherwise rows after it are dropped.

    ``enabled=False`` (every rank but the main one) makes every method a no-op.
    """

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None,
                 tensorboard_dir: str | os.PathLike | None = None, step_key: str = "step", enabled: bool = True):
        self.path = Path(path)
        self.step_key = step_key
        self.enabled = enabled
        self._f = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [] if resume_step is None else [r for r in read_rows(self.path) if r.get(step_key, 0) <= resume_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional heavy dependency: tensorboard
            except ImportError as e:
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install 'seqlab[tensorboard]'") from e
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=None if resume_step is None else resume_step + 1)

    def append(self, row: dict[str, Any]) -> None:
        """Write one row (non-finite floats become null, which JSON can hold) and mirror numbers to TensorBoard."""
        if not self.enabled:
            return
        if self._f is None:
            self._f = open(self.path, "a")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        if self._tb is not None and self.step_key in row:
            for k, v in row.items():
                if k != self.step_key and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=int(row[self.step_key]))
            self._tb.flush()

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path)

    def plot(self, png_path: str | os.PathLike, x: str, ys: Sequence[str], ylabel: str, title: str = "",
             hlines: dict[str, float] | None = None, *, ys_right: Sequence[str] = (), ylabel_right: str = "",
             logy: bool = False) -> Path | None:
        """Fields ``ys`` against field ``x`` as a PNG, written atomically (None when there is nothing to draw).

        The arguments are those of :meth:`figure`."""
        fig = self.figure(x, ys, ylabel, title, hlines, ys_right=ys_right, ylabel_right=ylabel_right, logy=logy)
        if fig is None:
            return None
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        atomic_write_bytes(png_path, buf.getvalue())
        return Path(png_path)

    def figure(self, x: str, ys: Sequence[str], ylabel: str, title: str = "", hlines: dict[str, float] | None = None,
               *, ys_right: Sequence[str] = (), ylabel_right: str = "", logy: bool = False) -> Figure | None:
        """Fields ``ys`` against field ``x`` (None when there is nothing to draw, or on a rank that does not log).

        ``hlines`` draws labelled reference levels (an exact energy, a target loss), each in its own colour and
        dash so that levels close together stay apart; ``ys_right`` go on a second axis with their own label
        (bits per byte next to a loss in nats).
        """
        if not self.enabled:
            return None
        from matplotlib.figure import Figure  # heavy (seconds to import): only plotting needs it

        rows = self.rows()
        series = {y: [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
                  for y in (*ys, *ys_right)}
        if not any(series.values()):
            return None
        fig = Figure(figsize=(7, 4.2))
        ax = fig.subplots()
        for y in ys:
            if series[y]:
                ax.plot(*zip(*series[y]), "-" if len(series[y]) > 20 else "o-", lw=1.0, ms=3, label=y)
        for i, (label, level) in enumerate((hlines or {}).items()):
            color, dash = REFERENCE_COLORS[i % len(REFERENCE_COLORS)], REFERENCE_DASHES[i % len(REFERENCE_DASHES)]
            ax.axhline(level, color=color, lw=1.2, ls=dash, label=label)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if any(series[y] for y in ys_right):
            ax2 = ax.twinx()
            for y in ys_right:
                if series[y]:
                    ax2.plot(*zip(*series[y]), "s--", ms=3, color="tab:green", label=y)
            ax2.set_ylabel(ylabel_right)
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="best")
        ax.set_title(title or self.path.parent.name)
        fig.tight_layout()
        return fig

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> Logbook:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
