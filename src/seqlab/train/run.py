"""Assemble a run from a TrainConfig: tokenizer -> datasets -> objective -> model. The one-way data path of
the house plan (``data`` -> ``objectives`` -> ``model`` -> ``train``) lives here, so the CLI, the demo and the
benchmarks all build runs the same way.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

import seqlab.train.checkpoint as ckpt
from seqlab.config import ModelConfig
from seqlab.data import build_dataset, build_tokenizer, load_tokenizer
from seqlab.data.datasets import example_texts, split_documents
from seqlab.model import build_model
from seqlab.objectives import build_objective, objective_class
from seqlab.runtime.errors import CheckpointError
from seqlab.runtime.files import atomic_path, atomic_write_text
from seqlab.runtime.store import sha256_file
from seqlab.train.config import TrainConfig, read_run_config, same_setting
from seqlab.train.presets import model_config

# Loads a model folder that is not a training checkpoint (seqlab or HF format) into a state dict. The CLI passes
# ``seqlab.io``'s loader (a model folder -> the model): io sits above train, so train cannot import it.
FolderLoader = Callable[[Path], torch.nn.Module]

# ModelConfig fields that do not change what a model with these weights computes: regularisation and
# initialisation, provenance, token ids (the tokenizer's business), and lengths (a learned table's shape is checked)
_NOT_MATH = {"dropout", "attn_dropout", "init_std", "extra", "max_seq_len", "attention_window", "pad_token_id",
             "bos_token_id", "eos_token_id", "decoder_start_token_id"}


def default_tokenizer(objective: str) -> str:
    """BPE for natural text (more text per token, so more learning per FLOP); bytes for the small synthetic
    tasks, whose strings are short and whose BPE would have to be trained on something else."""
    return "bpe:2048" if objective_class(objective).natural_text else "byte"


@dataclass
class Run:
    cfg: TrainConfig
    tokenizer: Any
    objective: Any
    model: torch.nn.Module
    train_data: Any
    val_data: Any


def build_tokenizer_for(cfg: TrainConfig, cache_dir: str | Path | None = None, resume: bool = False):
    """The run's tokenizer. A resumed run reuses the one saved in ``out_dir`` (it must, exactly), after checking
    that the saved run asked for the same tokenizer; a new run builds it from ``cfg.tokenizer``, BPE trained on the
    training split of ``--data`` where there is one (a seq2seq/sft/dpo file's example texts)."""
    out = Path(cfg.out_dir)
    saved = out / "tokenizer.json"
    spec = cfg.tokenizer or default_tokenizer(cfg.objective)
    if resume and saved.is_file():
        recorded = spec
        if (out / "config.json").is_file():
            run = read_run_config(out)
            if run.get("objective", cfg.objective) != cfg.objective:  # named first: it also changes the tokenizer
                raise ValueError(f"{out / 'config.json'}: cannot resume, the run configuration changed (objective: "
                                 f"{run.get('objective')!r} -> {cfg.objective!r})")
            recorded = run.get("tokenizer") or default_tokenizer(run.get("objective", cfg.objective))
        if not same_setting("tokenizer", recorded, spec):
            raise ValueError(f"{saved}: built for --tokenizer {recorded}, but this run asks for --tokenizer {spec}; "
                             "a resumed run must keep its tokenizer")
        return load_tokenizer(saved)
    train_texts = None
    natural = objective_class(cfg.objective).natural_text
    if spec.startswith("bpe") and (cfg.data is not None or not natural):  # the training split, never validation's
        train_texts = (split_documents(cfg.data, "train") if natural
                       else example_texts(cfg.objective, cfg.data, "train", cfg.seed))
    return build_tokenizer(spec, train_texts=train_texts, cache_dir=cache_dir or cfg.out_dir)


def dataset_options(cfg: TrainConfig) -> dict[str, Any]:
    return {"pack": bool(cfg.pack and objective_class(cfg.objective).can_pack), "document_bos": cfg.document_bos}


def row_length(cfg: TrainConfig) -> int:
    """Tokens per example: ``seq_len``, or DPO's ``max_len`` option where it is shorter (it cuts each pair, in the
    trainer as in ``DPO.tokenize``)."""
    max_len = cfg.objective_kwargs.get("max_len") if cfg.objective == "dpo" else None
    return min(cfg.seq_len, max_len) if max_len else cfg.seq_len


def validation_dataset(cfg: TrainConfig, tokenizer) -> Any:
    """The run's validation examples: all of ``--val-data`` when the run has one, else the held-out split of
    ``--data``. ``seqlab eval`` calls this too, so it scores what the trainer scored."""
    if cfg.val_data is not None:
        return build_dataset(cfg.objective, cfg.val_data, tokenizer, row_length(cfg), "all", cfg.seed,
                             **dataset_options(cfg))
    return build_dataset(cfg.objective, cfg.data, tokenizer, row_length(cfg), "validation", cfg.seed,
                         **dataset_options(cfg))


def build_datasets(cfg: TrainConfig, tokenizer) -> tuple[Any, Any]:
    train = build_dataset(cfg.objective, cfg.data, tokenizer, row_length(cfg), "train", cfg.seed,
                          **dataset_options(cfg))
    return train, validation_dataset(cfg, tokenizer)


def load_initial_weights(model: torch.nn.Module, path: str | os.PathLike, load_folder: FolderLoader | None = None) -> None:
    """Copy weights from a training checkpoint (or a run dir: its latest) or, through ``load_folder``, a
    seqlab/HF model folder."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        latest = ckpt.latest_checkpoint(p / "checkpoints")
        if latest is None:
            raise FileNotFoundError(f"{p}/checkpoints: no checkpoint to initialise from")
        p = latest
    if (p / "state.json").is_file():
        state, sd, _ = ckpt.load_checkpoint(p, load_optimizer=False)
        source = ModelConfig.from_dict(state["model_config"]) if state.get("model_config") else None
    elif load_folder is not None:
        loaded = load_folder(p)
        sd, source = loaded.state_dict(), getattr(loaded, "config", None)
    else:
        raise FileNotFoundError(f"--init {path}: not a seqlab training checkpoint or run directory")
    hint = "use the same --preset/--model settings and tokenizer as the run that wrote them"
    own = model.state_dict()
    for name, mine in own.items():  # before load_state_dict, whose message lists every mismatch in full
        if name in sd and tuple(sd[name].shape) != tuple(mine.shape):
            raise ValueError(f"--init {path}: {name} has shape {tuple(sd[name].shape)} there but "
                             f"{tuple(mine.shape)} in this model; {hint}")
    built = model.config
    for name in (f.name for f in dataclasses.fields(ModelConfig) if f.name not in _NOT_MATH and source is not None):
        # equal shapes do not make the same model: a rope base, norm eps or activation of another run would be
        # copied under this run's settings and compute something else, silently
        if getattr(source, name) != getattr(built, name):
            raise ValueError(f"--init {path}: its model has {name}={getattr(source, name)!r} but this run builds "
                             f"{name}={getattr(built, name)!r}; {hint}")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"--init {path}: weights do not fit the model (missing={missing[:5]}, "
                         f"unexpected={unexpected[:5]}); {hint}")


# A run whose objective keeps its initial model (DPO's reference) copies its --init weights here when it starts, so
# that its resume and `seqlab eval` do not depend on the run it came from: that one may train on and prune the
# checkpoint --init named (--keep-last), or move.
INIT_WEIGHTS = "init_weights.safetensors"
INIT_DIGEST = "init_weights.sha256"  # beside it: a flipped bit would otherwise change DPO's reference silently


def keep_init_weights(model: torch.nn.Module, run_dir: Path) -> None:
    """Write ``model``'s weights as ``run_dir``'s kept ``--init`` weights, with their sha256 beside them."""
    with atomic_path(run_dir / INIT_WEIGHTS) as tmp:
        save_model(model, str(tmp))
        atomic_write_text(run_dir / INIT_DIGEST, sha256_file(tmp) + "\n")


def _load_kept(model: torch.nn.Module, path: Path) -> None:
    """The kept ``--init`` weights into ``model``, checked against their recorded sha256 (runs made before it was
    recorded have none); any damage is a CheckpointError naming the file, not a safetensors traceback."""
    digest = path.with_name(INIT_DIGEST)
    if digest.is_file() and digest.read_text().strip() != sha256_file(path):
        raise CheckpointError(f"{path}: its sha256 differs from the one recorded in {digest.name} when the run "
                              "began; the file is damaged")
    try:
        load_model(model, str(path))  # safetensors: shared (tied) weights stored once, each name restored
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def kept_init_weights(run_dir: str | os.PathLike | None) -> Path | None:
    """``run_dir``'s copy of its ``--init`` weights, where it has one."""
    if run_dir is None:
        return None
    path = Path(run_dir) / INIT_WEIGHTS
    return path if path.is_file() else None


def initial_model(cfg: TrainConfig, mc: ModelConfig, load_folder: FolderLoader | None = None,
                  run_dir: str | os.PathLike | None = None) -> torch.nn.Module:
    """The weights training starts from: the seeded initialisation, or ``--init``'s weights (``run_dir``'s copy of
    them where it has one). One place, because DPO's frozen reference is this model and ``seqlab eval`` must
    rebuild the very same one."""
    torch.manual_seed(cfg.seed)  # model init independent of how much randomness data building used
    model = build_model(mc)
    kept = kept_init_weights(run_dir) if cfg.init else None
    if kept is not None:
        _load_kept(model, kept)
    elif cfg.init:
        load_initial_weights(model, cfg.init, load_folder)
    return model


def pin_init(cfg: TrainConfig) -> TrainConfig:
    """The config a new run records: where the objective rebuilds a reference from ``--init`` (DPO), on resume and
    in ``seqlab eval``, a run directory there would mean whatever its latest checkpoint is by then; so the run
    records the checkpoint folder it starts from, as an absolute path (the working directory may change too)."""
    if not cfg.init or not objective_class(cfg.objective).uses_initial_model:
        return cfg
    return cfg.replace(init=str(ckpt.resolve_checkpoint(cfg.init).resolve()))


def build_run(cfg: TrainConfig, resume: bool = False, load_folder: FolderLoader | None = None) -> Run:
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer_for(cfg, resume=resume)
    objective = build_objective(cfg.objective, tokenizer, **cfg.objective_kwargs)
    train, val = build_datasets(cfg, tokenizer)
    mc: ModelConfig = model_config(cfg.preset, objective.arch, tokenizer, cfg.seq_len, **cfg.model)
    model = initial_model(cfg, mc, load_folder, cfg.out_dir if resume else None)
    if cfg.init and not resume:
        check_init_tokenizer(cfg.init, tokenizer)
    return Run(cfg, tokenizer, objective, model, train, val)


def check_init_tokenizer(init: str | os.PathLike, tokenizer) -> None:
    """``--init`` weights learned each embedding row for one token of their own tokenizer: under another vocabulary of
    the same size every row would stand for another token, and training would go on without a word."""
    path = ckpt.resolve_checkpoint(init) / "tokenizer.json"
    if path.is_file() and load_tokenizer(path).backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError(f"--init {init}: its tokenizer ({path}) gives ids to other tokens than this run's; pass "
                         f"--tokenizer {path}")
