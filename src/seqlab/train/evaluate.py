"""``seqlab eval``: loss, perplexity and bits per byte of a trained checkpoint on a held-out split or a file.

A checkpoint directory is self-contained (weights, ``config.json``, ``tokenizer.json``, and the run's
TrainConfig in ``state.json``), so evaluation needs nothing but its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from seqlab.train import checkpoint as ckpt
from seqlab.train.config import TrainConfig


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest checkpoint)."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    for root in (p / "checkpoints", p):
        latest = ckpt.latest_checkpoint(root)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"{p}: no seqlab checkpoint here (expected state.json, or checkpoints/step_*/)")


def load_trained(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer, TrainConfig, checkpoint dir) from a checkpoint or run directory."""
    from seqlab.config import ModelConfig
    from seqlab.data import load_tokenizer
    from seqlab.model import build_model

    cdir = resolve_checkpoint(path)
    state, sd, _ = ckpt.load_checkpoint(cdir, load_optimizer=False)
    cfg = TrainConfig.from_dict(state["train_config"])
    model = build_model(ModelConfig.from_dict(state["model_config"]))
    model.load_state_dict(sd, strict=True)
    tok_path = cdir / "tokenizer.json"
    if not tok_path.is_file():
        raise ckpt.CheckpointError(f"{tok_path}: missing; cannot evaluate without the run's tokenizer")
    return model.to(device).eval(), load_tokenizer(tok_path), cfg, cdir


@torch.no_grad()
def evaluate_checkpoint(path: str | Path, data: str | None = None, split: str = "validation",
                        batch_size: int | None = None, max_batches: int | None = None, device: str = "cpu",
                        precision: str = "fp32") -> dict[str, Any]:
    from seqlab.data import build_dataset
    from seqlab.eval.metrics import evaluate
    from seqlab.objectives import build_objective
    from seqlab.train.precision import resolve_precision

    model, tok, cfg, cdir = load_trained(path, device)
    objective = build_objective(cfg.objective, tok, **cfg.objective_kwargs)
    if hasattr(objective, "setup"):
        objective.setup(model)  # DPO: without its original reference the margin is relative to this model
    kw = {"pack": True} if cfg.pack and cfg.objective == "clm" else {}
    if data is not None:
        ds = build_dataset(cfg.objective, data, tok, cfg.seq_len, "all", cfg.seed, **kw)
    else:
        ds = build_dataset(cfg.objective, cfg.data, tok, cfg.seq_len, split, cfg.seed, **kw)
    bs = batch_size or cfg.eval_batch_size or cfg.batch_size
    batches = (objective.collate([ds[j] for j in range(i, min(i + bs, len(ds)))]) for i in range(0, len(ds), bs))
    prec = resolve_precision(precision, torch.device(device))
    import contextlib

    scope = objective.evaluating() if hasattr(objective, "evaluating") else contextlib.nullcontext()
    with prec.autocast(), scope:
        res = evaluate(model, objective, batches, device=device, max_batches=max_batches)
    res.update(checkpoint=str(cdir), objective=cfg.objective, data=data or cfg.data or "embedded default",
               split="all" if data else split, examples=len(ds))
    return res
