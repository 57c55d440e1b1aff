"""What a run shows of itself while and after it trains: the progress bar's postfix and the loss curve."""

from __future__ import annotations

from pathlib import Path

from seqlab.runtime.logbook import Logbook


def progress_postfix(record: dict[str, float], last_eval: dict[str, float]) -> dict[str, str]:
    """The step's loss, learning rate and speed, and the last validation bits per byte where there is one."""
    post = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    return post | ({"val_bpb": f"{last_eval['val_bpb']:.3f}"} if "val_bpb" in last_eval else {})


def draw_loss_curve(logbook: Logbook, out_dir: Path, loss_label: str) -> None:
    """loss_curve.png: training and validation loss per step, validation bits per byte on the right axis."""
    try:
        logbook.plot(out_dir / "loss_curve.png", "step", ["loss", "val_loss"], loss_label, title=out_dir.name,
                     ys_right=["val_bpb"], ylabel_right="val bits per byte")
    except Exception as e:  # a plotting problem must not lose a finished run
        print(f"[seqlab] could not draw the loss curve: {e}")
