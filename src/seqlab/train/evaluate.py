"""``seqlab eval``: loss, perplexity and bits per byte of a trained checkpoint on a held-out split or a file.

A checkpoint directory is self-contained (weights, ``config.json``, ``tokenizer.json``, and the run's
TrainConfig in ``state.json``), so evaluation needs nothing but its path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

import seqlab.runtime.dist as D
import seqlab.train.checkpoint as ckpt
from seqlab.config import ModelConfig
from seqlab.data import build_dataset, load_tokenizer
from seqlab.data.corpus import normalise_split
from seqlab.eval.metrics import EvalTotals, evaluate
from seqlab.model import build_model
from seqlab.objectives import build_objective
from seqlab.runtime.dist import resolve_device
from seqlab.runtime.errors import CheckpointError
from seqlab.train.config import TrainConfig
from seqlab.train.precision import Precision, resolve_precision
from seqlab.train.run import (FolderLoader, dataset_options, initial_model, kept_init_weights, row_length,
                              validation_dataset)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return batch if device.type == "cpu" else {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor)
                                                    else v) for k, v in batch.items()}


@torch.no_grad()
def evaluate_on_ranks(model: torch.nn.Module, objective: Any, data: Any, batch_size: int, max_batches: int | None,
                      precision: Precision, info: D.DistInfo, pad_ranks: bool = False) -> EvalTotals:
    """The Trainer's evaluation: batches of ``data`` split over ranks, pooled into one ``EvalTotals`` on every rank
    (the same sums ``seqlab eval`` pools). ``pad_ranks``: every rank runs the same number of forwards, as FSDP
    needs (its ranks all-gather weights together)."""
    was_training = model.training
    model.eval()
    starts = list(range(0, len(data), batch_size))[:max_batches]
    mine = list(enumerate(starts))[info.rank::info.world_size]
    if pad_ranks:
        mine = mine + [(0, None)] * (math.ceil(len(starts) / info.world_size) - len(mine))
    totals = EvalTotals()
    with objective.evaluating():  # MLM: the same masks every time, without moving the training RNG
        for index, s in mine:
            first = starts[0] if s is None else s  # None: a padding forward that only keeps the ranks in step
            rows = [data[i] for i in range(first, min(first + batch_size, len(data)))]
            objective.at_batch(index)  # MLM: batch `index` is masked alike on any rank
            batch = to_device(objective.collate(rows), info.device)
            with precision.autocast():
                out = objective.loss(model, batch)
            if s is not None:
                totals.add(out, batch, objective.byte_table)
    summed = D.all_reduce_sum(totals.as_tensor(info.collective_device), info)
    model.train(was_training)
    return EvalTotals.from_tensor(summed, info.world_size)


def load_trained(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer, TrainConfig, checkpoint dir) from a checkpoint or run directory."""
    cdir = ckpt.resolve_checkpoint(path)
    state, sd, _ = ckpt.load_checkpoint(cdir, load_optimizer=False)
    cfg = TrainConfig.from_dict(state["train_config"])
    model = build_model(ModelConfig.from_dict(state["model_config"]))
    model.load_state_dict(sd, strict=True)
    tok_path = cdir / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{tok_path}: missing; cannot evaluate without the run's tokenizer")
    return model.to(device).eval(), load_tokenizer(tok_path), cfg, cdir


def _eval_data(cfg: TrainConfig, tok: Any, data: str | None, split: str | None) -> tuple[Any, str, str]:
    """(examples, what they are, split) for ``seqlab eval``: ``data`` whole, or its ``split`` where one is asked
    for (by the training rule: every 20th example); else the run's validation set exactly as the trainer built it
    (its ``--val-data`` if it had one), or the training split of its ``--data``."""
    if data is not None:
        split = "all" if split is None or split == "all" else normalise_split(split)
        ds = build_dataset(cfg.objective, data, tok, row_length(cfg), split, cfg.seed, **dataset_options(cfg))
        return ds, data, split
    split = split or "validation"
    if split != "all" and normalise_split(split) == "validation" and cfg.val_data is not None:
        return validation_dataset(cfg, tok), cfg.val_data, "all"
    ds = build_dataset(cfg.objective, cfg.data, tok, row_length(cfg), split, cfg.seed, **dataset_options(cfg))
    return ds, cfg.data or "embedded default", split if split == "all" else normalise_split(split)


def _setup_objective(objective: Any, model: torch.nn.Module, cfg: TrainConfig, load_folder: FolderLoader | None,
                     device: torch.device, cdir: Path) -> None:
    """Call ``objective.setup`` as the Trainer did: with the run's initial model when the objective keeps it (DPO's
    reference; with the trained model instead every DPO loss would read ln 2), else with the model itself."""
    if not objective.uses_initial_model:
        objective.setup(model)
        return
    run_dir = cdir.parent.parent if cdir.parent.name == "checkpoints" else None
    if cfg.init and not Path(cfg.init).exists() and kept_init_weights(run_dir) is None:
        raise ValueError(f"--init {cfg.init}: no such file or directory; this {cfg.objective} run is scored against "
                         "its initial model, which is rebuilt from those weights")
    with torch.random.fork_rng(devices=[]):  # rebuilding the seeded init must not move the caller's RNG
        initial = initial_model(cfg, model.config, load_folder, run_dir)
    objective.setup(initial.to(device).eval())


def _eval_precision(asked: str, run: str, device: torch.device) -> Precision:
    """``auto`` means the run's own precision, where this device has it: an fp16 GPU run scored on a CPU is
    scored in fp32 (CPUs have no fp16 autocast here), not refused."""
    if asked != "auto":
        return resolve_precision(asked, device, "--precision")
    return resolve_precision("fp32" if run == "fp16" and device.type == "cpu" else run, device)


@torch.no_grad()
def evaluate_checkpoint(path: str | Path, data: str | None = None, split: str | None = None,
                        batch_size: int | None = None, max_batches: int | None = None, device: str = "cpu",
                        precision: str = "fp32", show_progress: bool = False,
                        load_folder: FolderLoader | None = None) -> dict[str, Any]:
    """Score a checkpoint as the trainer scored it: the same validation set, reference model (DPO) and, with
    ``precision="auto"``, the run's precision. ``load_folder`` reads a model-folder ``--init`` (see train/run.py)."""
    dev = resolve_device(device)
    model, tok, cfg, cdir = load_trained(path, dev)
    objective = build_objective(cfg.objective, tok, **cfg.objective_kwargs)
    _setup_objective(objective, model, cfg, load_folder, dev, cdir)
    ds, source, split_name = _eval_data(cfg, tok, data, split)
    bs = batch_size or cfg.eval_batch_size or cfg.batch_size
    starts = range(0, len(ds), bs)
    batches = (objective.collate([ds[j] for j in range(i, min(i + bs, len(ds)))]) for i in starts)
    run_precision = _eval_precision(precision, cfg.precision, dev)
    with run_precision.autocast(), objective.evaluating():
        res = evaluate(model, objective, batches, device=dev, max_batches=max_batches, total=len(starts),
                       show_progress=show_progress)
    if res["n_targets"] == 0:  # a mean over nothing: "loss 0, perplexity 1" would read as a perfect model
        raise ValueError(f"nothing to score: {source} ({split_name}) gives the {cfg.objective} objective no targets "
                         f"in {len(ds)} example(s)")
    res.update(checkpoint=str(cdir), objective=cfg.objective, data=source, split=split_name, examples=len(ds),
               precision=run_precision.name)
    return res
