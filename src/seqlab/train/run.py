"""Assemble a run from a TrainConfig: tokenizer -> datasets -> objective -> model. The one-way data path of
the house plan (``data`` -> ``objectives`` -> ``model`` -> ``train``) lives here, so the CLI, the demo and the
benchmarks all build runs the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seqlab.train.config import TrainConfig
from seqlab.train.presets import model_config

TEXT_OBJECTIVES = ("clm", "mlm")


def default_tokenizer(objective: str) -> str:
    """BPE for natural text (more text per token, so more learning per FLOP); bytes for the small synthetic
    tasks, whose strings are short and whose BPE would have to be trained on something else."""
    return "bpe:2048" if objective in TEXT_OBJECTIVES else "byte"


@dataclass
class Run:
    cfg: TrainConfig
    tokenizer: Any
    objective: Any
    model: torch.nn.Module
    train_data: Any
    val_data: Any


def build_tokenizer_for(cfg: TrainConfig, cache_dir: str | Path | None = None):
    """The run's tokenizer: the one saved in ``out_dir`` if present (a resumed run must reuse it exactly),
    else built from ``cfg.tokenizer`` — BPE trained on the run's own text file when ``--data`` is a text file."""
    from seqlab.data import build_tokenizer, load_tokenizer

    saved = Path(cfg.out_dir) / "tokenizer.json"
    if saved.is_file():
        return load_tokenizer(saved)
    spec = cfg.tokenizer or default_tokenizer(cfg.objective)
    train_texts = None
    if spec.startswith("bpe") and cfg.data is not None and cfg.objective in TEXT_OBJECTIVES:
        from seqlab.data.readers import read_documents

        train_texts = read_documents(cfg.data)
    return build_tokenizer(spec, train_texts=train_texts, cache_dir=cache_dir or cfg.out_dir)


def build_datasets(cfg: TrainConfig, tokenizer) -> tuple[Any, Any]:
    from seqlab.data import build_dataset

    rows = cfg.seq_len  # tokens per row the model sees (a clm row of T tokens scores T-1 next tokens)
    kw = {"pack": True} if cfg.pack and cfg.objective == "clm" else {}
    train = build_dataset(cfg.objective, cfg.data, tokenizer, rows, "train", cfg.seed, **kw)
    if cfg.val_data is not None:
        val = build_dataset(cfg.objective, cfg.val_data, tokenizer, rows, "all", cfg.seed, **kw)
    else:
        val = build_dataset(cfg.objective, cfg.data, tokenizer, rows, "validation", cfg.seed, **kw)
    return train, val


def load_initial_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Copy weights from a training checkpoint (or a run dir: its latest) or a seqlab/HF model folder."""
    from seqlab.train import checkpoint as ckpt

    p = Path(path)
    if (p / "checkpoints").is_dir():
        latest = ckpt.latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise FileNotFoundError(f"{p}/checkpoints: no checkpoint to initialise from")
        p = latest
    if (p / "state.json").is_file():
        _, sd, _ = ckpt.load_checkpoint(p, load_optimizer=False)
    else:
        from seqlab.io.checkpoint import load_pretrained

        sd = load_pretrained(p).state_dict()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit the model (missing={missing[:5]}, unexpected={unexpected[:5]}); "
                         "use the same --preset/--model settings as the run that wrote them")


def build_run(cfg: TrainConfig) -> Run:
    from seqlab.model import build_model
    from seqlab.objectives import build_objective

    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer_for(cfg)
    objective = build_objective(cfg.objective, tokenizer, **cfg.objective_kwargs)
    train, val = build_datasets(cfg, tokenizer)
    mc = model_config(cfg.preset, objective.arch, tokenizer, cfg.seq_len, **cfg.model)
    torch.manual_seed(cfg.seed)  # model init independent of how much randomness data building used
    model = build_model(mc)
    if cfg.init:
        load_initial_weights(model, cfg.init)
    return Run(cfg, tokenizer, objective, model, train, val)
