"""TrainConfig: every knob of one training run, validated on construction, stored in each checkpoint.

Why one dataclass: a run is reproducible only if everything that shaped it is written down next to its
weights. The CLI builds a TrainConfig, the Trainer reads nothing else, and ``state.json`` of every checkpoint
holds ``to_dict()`` so ``--resume`` can refuse a config that changed in a way that breaks exact resumption.
"""

from __future__ import annotations

import dataclasses
import filecmp
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seqlab.config import ConfigError, ModelConfig
from seqlab.objectives import OBJECTIVES, check_objective_options
from seqlab.runtime.files import read_json_object

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PARALLEL = ("none", "ddp", "fsdp")
SCHEDULES = ("cosine", "constant")


class TrainConfigError(ConfigError):
    """A training configuration value is invalid; the message names the field."""

    owner = "TrainConfig"


@dataclass
class TrainConfig:
    """One training run. Batch sizes are in sequences; one optimizer step sees
    ``batch_size * grad_accum * world_size`` sequences (the *global batch*)."""

    objective: str = "clm"
    out_dir: str = "runs/train"
    seed: int = 1337

    # what to train on and with (see train/run.py); recorded so that eval/resume rebuild the same run
    data: str | None = None  # None: the objective's embedded default (Shakespeare, synthetic tasks)
    val_data: str | None = None  # None: the held-out split of ``data`` (or of the default)
    tokenizer: str | None = None  # "byte" | "bpe[:N]" | path; None: bpe:2048 for clm/mlm, byte otherwise
    preset: str = "small"  # model size, see train/presets.py
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides on top of the preset
    init: str | None = None  # start from these weights (a checkpoint dir or a seqlab/HF model folder)
    pack: bool = False  # clm: pack whole documents into rows with a document mask
    document_bos: bool = True  # clm: BOS before each document of the stream (False: runs recorded before it was)

    # data / batching
    seq_len: int | None = None  # None: the objective's ``default_seq_len`` (128; sft 256: every built-in chat fits)
    batch_size: int = 16  # micro-batch per rank
    grad_accum: int = 1  # micro-batches per rank per optimizer step

    # optimisation
    max_steps: int = 1000
    max_time_s: float | None = None  # wall-clock budget of training proper (eval excluded); see schedule.py
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    warmup_frac: float | None = None  # if set, warmup length as a fraction of training (time- or step-based)
    schedule: str = "cosine"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0

    # numerics / speed
    precision: str = "auto"  # auto: bf16 where the device does it fast, fp16+GradScaler on old GPUs, else fp32
    compile: bool = False
    activation_checkpointing: bool = False
    device: str = "auto"
    num_threads: int | None = None

    # parallelism (torchrun sets the ranks; "none" only with one process: several would train unsynchronised copies)
    parallel: str = "ddp"  # used only when WORLD_SIZE > 1

    # evaluation, logging, checkpoints
    eval_interval: int = 200  # steps; 0 disables periodic eval (a final eval still runs)
    eval_interval_s: float | None = None  # also evaluate every this many training seconds (wall-clock curves)
    eval_batches: int | None = None  # None: the whole validation split
    eval_batch_size: int | None = None
    log_interval: int = 10
    ckpt_interval: int = 500  # steps; 0: only the final checkpoint
    keep_last: int = 3
    progress: bool = True
    plot: bool = True

    # objective-specific keyword arguments passed to objectives.build_objective
    objective_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        if self.seq_len is None:
            self.seq_len = getattr(OBJECTIVES.get(self.objective), "default_seq_len", 128)
        positive = ("seq_len", "batch_size", "grad_accum", "max_steps", "log_interval", "keep_last")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TrainConfigError(name, f"must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "eval_interval", "ckpt_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TrainConfigError(name, f"must be a non-negative integer, got {value!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TrainConfigError("lr", f"must be a positive finite number, got {self.lr!r}")
        for name in ("weight_decay", "eps"):  # `nan < 0` is False: the range checks below would let NaN through
            if not math.isfinite(getattr(self, name)):
                raise TrainConfigError(name, f"must be a finite number, got {getattr(self, name)!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise TrainConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.warmup_frac is not None and not 0.0 <= self.warmup_frac < 1.0:
            raise TrainConfigError("warmup_frac", f"must be in [0, 1), got {self.warmup_frac!r}")
        for name in ("max_time_s", "eval_interval_s"):  # (0 divided by zero; a negative one looped for ever)
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise TrainConfigError(name, f"must be a positive finite number of seconds, got {value!r}")
        if self.weight_decay < 0:
            raise TrainConfigError("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise TrainConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise TrainConfigError("grad_clip", f"must be positive or None, got {self.grad_clip!r}")
        if self.precision not in PRECISIONS:
            raise TrainConfigError("precision", f"unknown precision {self.precision!r}; expected one of {PRECISIONS}")
        if self.parallel not in PARALLEL:
            raise TrainConfigError("parallel", f"unknown mode {self.parallel!r}; expected one of {PARALLEL}")
        if self.schedule not in SCHEDULES:
            raise TrainConfigError("schedule", f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        for name, flag in (("eval_batches", "--eval-batches"), ("eval_batch_size", "--eval-batch-size"),
                           ("num_threads", "--threads")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise TrainConfigError(name, f"({flag}) must be a positive integer, got {value!r}")
        if self.objective not in OBJECTIVES:
            raise TrainConfigError("objective", f"unknown objective {self.objective!r}; expected one of {sorted(OBJECTIVES)}")
        try:  # now, before a run folder is written: a bad value would otherwise surface mid-run, or as a TypeError
            check_objective_options(self.objective, self.objective_kwargs)
        except ValueError as e:
            raise TrainConfigError("objective_kwargs", f"(--objective-arg) {e}") from None
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise TrainConfigError("model", f"{unknown[0]!r} (from --model {unknown[0]}=...) is not a ModelConfig "
                                            f"field; known fields: {', '.join(sorted(known))}")
        fixed = {"arch": "comes from --objective", "extra": "is seqlab's own record of where a model came from"}
        for name in sorted(set(self.model) & set(fixed)):  # (arch=... reached the model builder twice: a TypeError)
            raise TrainConfigError("model", f"{name!r} (from --model {name}=...) cannot be set: it {fixed[name]}")

    def warnings(self) -> list[str]:
        """Settings that are valid but probably not meant (printed, not refused)."""
        out = []
        if self.warmup_frac is None and self.max_time_s is None and self.max_steps < self.warmup_steps:
            peak = (self.max_steps) / (self.warmup_steps + 1)
            out.append(f"--max-steps {self.max_steps} is below --warmup-steps {self.warmup_steps}: training ends "
                       f"still in warmup, at {peak:.0%} of the peak learning rate, with no decay; lower "
                       "--warmup-steps (or use --warmup-frac) if that is not meant")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainConfigError(unknown[0], f"unknown field(s) {unknown}")
        # a run recorded before document_bos existed trained on a stream without BOS: eval and --resume rebuild that
        return cls(**{"document_bos": False, **data})

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# Fields that may change between a checkpoint and its resumption without breaking exactness. ``init`` may, since
# the resumed weights come from the checkpoint, except where the objective rebuilds a reference from it (DPO: the
# Trainer freezes it). ``max_steps`` may, but it re-stretches the schedule (the Trainer warns) and may not fall
# below the resumed step. ``grad_accum`` and ``parallel`` may, so that a run moves to another number of processes:
# the data order is a function of the global batch only, which the sampler checks is unchanged (``train/order.py``).
RESUME_MUTABLE = frozenset({
    "out_dir", "init", "val_data", "eval_interval_s", "max_steps", "max_time_s", "eval_interval", "eval_batches",
    "eval_batch_size", "log_interval", "ckpt_interval", "keep_last", "progress", "plot", "compile",
    "activation_checkpointing", "num_threads", "device", "grad_accum", "parallel",
})


def names_a_file(key: str, value: Any) -> bool:
    """Whether setting ``key`` = ``value`` is a file the run reads: its data, or a tokenizer given as a file (not
    a spec such as ``bpe:2048``). A run records these absolute, so eval and --resume may run from another folder."""
    return isinstance(value, str) and (key in ("data", "val_data") or key == "tokenizer" and Path(value).is_file())


def same_setting(key: str, old: Any, new: Any) -> bool:
    """Equal, or, for a file a run reads, the same file: the same path (runs recorded before paths were absolute
    hold them as typed, relative to the folder they ran in, which is where their resume reads them), a link to it or
    a copy of its bytes, or the file moved (the recorded path is gone, and the new one is named on purpose)."""
    if names_a_file(key, new) and isinstance(old, str):
        if os.path.abspath(old) == os.path.abspath(new) or not os.path.exists(old):
            return True
        return os.path.isfile(old) and (os.path.samefile(old, new) or filecmp.cmp(old, new, shallow=False))
    return old == new


def read_run_config(out_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``train`` section of ``<out_dir>/config.json``; a damaged file is named in the error."""
    path = Path(out_dir) / "config.json"
    doc = read_json_object(path)
    if not isinstance(doc.get("train"), dict):
        raise ValueError(f"{path}: no \"train\" section; not a seqlab run configuration")
    return doc["train"]
