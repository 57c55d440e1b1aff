"""metrics.jsonl writer and the loss-curve plot.

One JSON object per logged step: ``step, loss, lr, tokens_per_s`` always, plus ``grad_norm, tokens_seen,
train_seconds, elapsed_s`` and, on steps where evaluation ran, ``val_loss, val_ppl, val_bpb``. Eval results are
merged into the same record (not a separate record without ``loss``) so every line has the documented keys.
The file is appended and flushed per line, so a crash loses at most the line being written; on resume the lines
after the checkpoint's step are dropped, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._f = None

    def truncate_after(self, step: int) -> None:
        """Keep only records with ``step <= step`` (used when resuming from a checkpoint at ``step``)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if isinstance(rec, dict) and rec.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)

    def reset(self) -> None:
        if self.enabled and self.path.exists():
            self.path.unlink()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_loss_curve(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "") -> Path | None:
    """Train loss (and validation loss / bits per byte where present) against step, as a PNG."""
    records = read_metrics(metrics_path) if Path(metrics_path).is_file() else []
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if r.get("loss") is not None]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    bpb = [(r["step"], r["val_bpb"]) for r in records if r.get("val_bpb") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, losses, lw=1.0, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", ms=3, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / target)")
    ax.grid(alpha=0.3)
    if bpb:
        ax2 = ax.twinx()
        ax2.plot(*zip(*bpb), "s--", ms=3, color="tab:green", label="val bits/byte")
        ax2.set_ylabel("val bits per byte")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper right")
    else:
        ax.legend(loc="upper right")
    ax.set_title(title or Path(metrics_path).parent.name)
    fig.tight_layout()
    png_path = Path(png_path)
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
