"""``seqlab train | eval | demo``: training jobs on the command line.

    seqlab train --objective clm --preset small --out runs/clm            # embedded Shakespeare, BPE
    seqlab train --objective sft --data chats.jsonl --out runs/sft --max-steps 500
    seqlab train --out runs/clm --resume                                  # continue from the latest checkpoint
    seqlab train --out runs/clm --overwrite ...                           # move the old run aside, start anew
    torchrun --nproc_per_node 2 -m seqlab train --out runs/ddp ...        # DDP (gloo on CPU)
    seqlab eval runs/clm                                                  # loss, perplexity, bits per byte
    seqlab demo --out runs/demo                                           # what `make demo` runs

Every training option defaults to "not given": with ``--resume`` the run's saved configuration is reused and
only the options given on the command line change (those that would break exact resumption are refused).
The first SIGINT or SIGTERM finishes the step, writes a checkpoint and exits with 128 + the signal's number
(130 or 143, as a shell reports death by that signal, so schedulers see the run did not finish); a second
SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

import torch

from seqlab.accel import AccelPlan, accelerate
from seqlab.config import ConfigError
from seqlab.io.checkpoint import load_pretrained
from seqlab.objectives import OBJECTIVES
from seqlab.runtime.dist import resolve_device
from seqlab.runtime.files import atomic_write_text, check_readable_file, check_writable_file, ensure_writable_dir
from seqlab.runtime.memory import keep_freed_blocks
from seqlab.runtime.rundir import claim_run_dir, removed_if_left_empty
from seqlab.train.config import TrainConfig, names_a_file, read_run_config
from seqlab.train.demo import run_demo as demo
from seqlab.train.evaluate import evaluate_checkpoint
from seqlab.train.run import build_run, kept_init_weights, pin_init
from seqlab.train.rundir import existing_run, nothing_trained
from seqlab.train.trainer import Trainer

# (flag, TrainConfig field, type, help)
_TRAIN_OPTIONS = [
    ("--data", "data", str, "training data file (default: the objective's embedded data)"),
    ("--val-data", "val_data", str, "validation data file (default: the held-out split of --data)"),
    ("--tokenizer", "tokenizer", str, "byte | bpe | bpe:<vocab> | path/to/tokenizer.json (default: bpe:2048 for "
                                      "clm/mlm, byte otherwise)"),
    ("--preset", "preset", str, "model size: tiny | small | demo | base | gpt2 (default small)"),
    ("--init", "init", str, "start from these weights (a run/checkpoint dir or a model folder), e.g. SFT before DPO"),
    ("--seq-len", "seq_len", int, "tokens per row (default 128; sft 256)"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch per process (default 16)"),
    ("--grad-accum", "grad_accum", int, "micro-batches per optimizer step (default 1)"),
    ("--max-steps", "max_steps", int, "optimizer steps (default 1000)"),
    ("--max-time", "max_time_s", float, "training-time budget in seconds; the cosine schedule follows it"),
    ("--lr", "lr", float, "peak learning rate (default 3e-3)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "final lr as a fraction of the peak (default 0.1)"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps (default 100)"),
    ("--warmup-frac", "warmup_frac", float, "warmup as a fraction of training instead of steps"),
    ("--schedule", "schedule", str, "cosine | constant (default cosine)"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay on matrices (default 0.1)"),
    ("--grad-clip", "grad_clip", float, "clip the global gradient norm (default 1.0)"),
    ("--precision", "precision", str, "auto | fp32 | bf16 | fp16 (default auto: the fast one for the device)"),
    ("--device", "device", str, "auto | cpu | cuda[:N] (default auto: a GPU if any)"),
    ("--threads", "num_threads", int, "torch CPU threads (default: one per core, shared out between torchrun "
                                      "processes)"),
    ("--parallel", "parallel", str, "ddp | fsdp under torchrun (default ddp); none: one process only"),
    ("--eval-interval", "eval_interval", int, "evaluate every N steps (default 200; 0: only at the end)"),
    ("--eval-batches", "eval_batches", int, "batches per evaluation (default: the whole split)"),
    ("--eval-batch-size", "eval_batch_size", int, "rows per evaluation batch (default: --batch-size); with "
                                                  "--eval-batches, the same rows under any number of processes"),
    ("--log-interval", "log_interval", int, "write metrics every N steps (default 10)"),
    ("--ckpt-interval", "ckpt_interval", int, "checkpoint every N steps (default 500; 0: only at the end)"),
    ("--keep-last", "keep_last", int, "checkpoints to keep (default 3)"),
    ("--seed", "seed", int, "random seed (default 1337)"),
]


def _key_value(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        value = json.loads(v)
    except json.JSONDecodeError:
        value = v
    return k.strip(), value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model with one of the objectives",
                       description=f"Train {' | '.join(OBJECTIVES)}. Writes OUT/metrics.jsonl, "
                                   "OUT/checkpoints/step_*/ and OUT/loss_curve.png.")
    p.add_argument("--objective", choices=list(OBJECTIVES), default=None,
                   help=f"training objective (default {TrainConfig.objective})")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    p.add_argument("--overwrite", action="store_true",
                   help="OUT already holds a run: move it to OUT.old-<time> and start a new one")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also write the metrics as TensorBoard events to DIR (needs the tensorboard package)")
    for flag, dest, typ, hlp in _TRAIN_OPTIONS:
        p.add_argument(flag, dest=dest, type=typ, default=None, help=hlp)
    p.add_argument("--model", dest="model", type=_key_value, action="append", default=None, metavar="KEY=VALUE",
                   help="ModelConfig override on top of the preset, e.g. --model d_model=192 (repeatable)")
    p.add_argument("--objective-arg", dest="objective_kwargs", type=_key_value, action="append", default=None,
                   metavar="KEY=VALUE", help="objective option, e.g. --objective-arg beta=0.2 (repeatable)")
    p.add_argument("--pack", action="store_const", const=True, default=None, help="clm: pack documents into rows")
    p.add_argument("--compile", action="store_const", const=True, default=None, help="torch.compile the model")
    p.add_argument("--activation-checkpointing", action="store_const", const=True, default=None,
                   help="recompute each block in the backward pass (less memory, ~30%% more compute)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                   help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    p.set_defaults(func=run_train)

    e = sub.add_parser("eval", help="evaluate a trained checkpoint (loss, perplexity, bits per byte)",
                       description="Evaluate a run directory (its latest checkpoint) or a checkpoint directory.")
    e.add_argument("checkpoint", help="run directory or checkpoints/step_* directory")
    e.add_argument("--data", default=None, help="evaluate on this file (default: the run's held-out split)")
    e.add_argument("--split", default=None,
                   help="train | validation (default: validation; with --data the whole file unless given)")
    e.add_argument("--batch-size", type=int, default=None, help="sequences per batch (default: the run's)")
    e.add_argument("--max-batches", type=int, default=None, help="score only the first N batches (default: all)")
    e.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda[:N], or auto")
    e.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "auto"),
                   help="fp32 | bf16 | fp16 (GPU) | auto (auto: the run's precision; default fp32)")
    e.add_argument("--json", dest="json_out", default=None, help="also write the results to this JSON file")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    e.add_argument("--debug", action="store_true")
    e.set_defaults(func=run_eval)

    d = sub.add_parser("demo", help="train a small LM on the embedded Shakespeare, evaluate, sample",
                       description="The main job end to end: BPE, a time-budgeted causal LM, bits per byte on the "
                                   "held-out play, samples. Writes OUT/summary.json.")
    d.add_argument("--out", default="runs/demo", help="the run's folder (default runs/demo)")
    d.add_argument("--time", type=float, default=300.0, help="training budget in seconds (default 300)")
    d.add_argument("--seed", type=int, default=1337, help="seed of the run and its samples (default 1337)")
    d.add_argument("--samples", type=int, default=3, help="text samples printed at the end (default 3)")
    d.add_argument("--max-new-tokens", type=int, default=120, help="tokens per sample (default 120)")
    d.add_argument("--preset", default=None, help="override the tuned model size")
    d.add_argument("--threads", dest="num_threads", type=int, default=None,
                   help="CPU threads (default: the idle cores, by the load average)")
    d.add_argument("--precision", default=None,
                   help="fp32 | bf16 | auto (default auto: bf16 where the device runs it fast, else fp32)")
    d.add_argument("--no-progress", dest="progress", action="store_false")
    d.add_argument("--debug", action="store_true")
    d.set_defaults(func=run_demo)


def _given(args: argparse.Namespace) -> dict:
    fields = [dest for _, dest, _, _ in _TRAIN_OPTIONS] + ["objective", "pack", "compile", "activation_checkpointing",
                                                           "progress"]
    out = {k: getattr(args, k) for k in fields if getattr(args, k, None) is not None}
    for k in ("model", "objective_kwargs"):
        if getattr(args, k, None):
            out[k] = dict(getattr(args, k))
    return out


def make_config(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from the command line; with --resume, from OUT/config.json updated by the given options."""
    given = _given(args)
    for key, value in list(given.items()):
        if names_a_file(key, value):
            given[key] = os.path.abspath(value)
    if args.resume and (Path(args.out) / "config.json").is_file():
        base = read_run_config(args.out)
        base.update(given)
        base["out_dir"] = args.out
        try:
            cfg = TrainConfig.from_dict(base)
        except ConfigError as e:  # a recorded value (not one given now) is bad: name the file it came from
            if getattr(e, "field", None) in given:
                raise
            raise ValueError(f"{Path(args.out) / 'config.json'}: {e}") from None
    else:
        cfg = TrainConfig(out_dir=args.out, **given)
    _check_options(cfg, given)
    return cfg


def _check_options(cfg: TrainConfig, given: dict) -> None:
    """Options that are valid alone but not together, refused before a run folder is made."""
    if given.get("pack") and not OBJECTIVES[cfg.objective].can_pack:
        packing = ", ".join(sorted(name for name, cls in OBJECTIVES.items() if cls.can_pack))
        raise ValueError(f"--pack packs documents into rows for {packing}; the {cfg.objective} objective builds its "
                         "own rows: drop --pack")
    if "warmup_steps" in given and "warmup_frac" in given:
        raise ValueError("--warmup-steps and --warmup-frac both set the warmup (the fraction would win): give one")
    if "min_lr_ratio" in given and cfg.schedule == "constant":
        raise ValueError("--min-lr-ratio is where the cosine ends; --schedule constant never decays: drop one")
    context = cfg.model.get("max_seq_len")
    if isinstance(context, int) and context < cfg.seq_len:
        raise ValueError(f"--model max_seq_len={context} is shorter than --seq-len {cfg.seq_len}: training rows would "
                         "run past the model's context; raise max_seq_len or lower --seq-len")


def _accel_line(plan: AccelPlan) -> str:
    """What ``accelerate(model, "train")`` put in, in one line: each kernel with the dtypes it runs, and how many
    linear layers left the plain product (a user sees which measured choice the run took; `seqlab info` for inference
    prints the whole table)."""
    kernels = [f"{name}: {what}" for name, what in (("GELU", plan.act), ("LayerNorm", plan.norm),
                                                     ("attention", plan.train_attention),
                                                     ("cross-entropy", plan.cross_entropy)) if what]
    shapes = plan.shapes.get(plan.dtype, [])
    routed = sum(c.count for c in shapes if c.route != "dense")
    products = f"{routed} of {sum(c.count for c in shapes)} linear layers on a routed product"
    return "; ".join([*kernels, products]) if kernels else f"torch's ops; {products}"


def _load_model_folder(path: Path) -> torch.nn.Module:
    return load_pretrained(path)


def _check_inputs_exist(cfg: TrainConfig, resume: bool) -> None:
    for flag, path in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if path is not None and resume and not Path(path).exists():  # moved since the run recorded it
            raise ValueError(f"{flag} {path}: file not found; if the run's file has moved, resume with {flag} "
                             "naming it where it is now")
        if path is not None:
            check_readable_file(path, flag)
    if cfg.init and not Path(cfg.init).exists() and not (resume and kept_init_weights(cfg.out_dir)):
        raise ValueError(f"--init {cfg.init}: not found (a run directory, checkpoint or model folder)")


def run_train(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other: continue the run in --out, or replace it")
    main_rank = int(os.environ.get("RANK", "0")) == 0
    cfg = make_config(args)  # every option checked before --overwrite moves an old run aside
    resolve_device(cfg.device)  # a missing GPU fails now, not after the data is built
    _check_inputs_exist(cfg, args.resume)  # and its files (their contents are read, and checked, after the move)
    # a run that fails before it trained anything leaves no folder behind, so the corrected command runs as given
    with removed_if_left_empty(args.out, nothing_trained if main_rank else None):
        return _train(args, cfg, main_rank)


def _train(args: argparse.Namespace, cfg: TrainConfig, main_rank: bool) -> int:
    if args.resume:
        if main_rank and existing_run(args.out) is None:  # a retry loop's first launch, or a mistyped --out: say which
            print(f"[seqlab] --resume: {args.out} holds no run yet; starting a new one there", file=sys.stderr)
        ensure_writable_dir(args.out, "--out")
    elif main_rank:
        moved = claim_run_dir(args.out, existing_run(args.out), overwrite=args.overwrite)
        if moved is not None:
            print(f"[seqlab] --overwrite: the previous run in {args.out} was moved to {moved}")
    if not args.resume:
        cfg = pin_init(cfg)  # after the move, so an --init naming the replaced run is not pinned to its old place
    run = build_run(cfg, resume=args.resume, load_folder=_load_model_folder)
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        # same Parameters: the product routes, the GELU and the causal attention, each where it times faster
        accelerate(run.model, "train", rows=cfg.batch_size * cfg.seq_len, dtype=None, seq_len=cfg.seq_len)
        keep_freed_blocks()  # each step reuses the last step's pages instead of faulting in fresh ones
        if main_rank and "accel_plan" in run.model.__dict__:
            print(f"[seqlab] timed on this CPU: {_accel_line(run.model.accel_plan)}", flush=True)
    trainer = Trainer(cfg, run.model, run.objective, run.train_data, run.val_data, tokenizer=run.tokenizer,
                      resume=args.resume, tensorboard_dir=args.tensorboard)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    if trainer.dist.is_main:
        ev = " ".join(f"{k}={v:.4g}" for k, v in result.eval.items() if isinstance(v, float))
        if ev and result.eval_step is not None and result.eval_step != result.step:  # a stop between evaluations
            ev = f"(validation at step {result.eval_step}: {ev})"
        loss = f"{result.loss:.4f}" if result.loss is not None else "n/a"
        print(f"[seqlab] step {result.step} loss {loss} {ev} "
              f"({result.tokens_seen:,} tokens in {result.train_seconds:.1f} s) -> {result.checkpoint}")
    if result.signal is not None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        how = (f"the same torchrun command with --resume (or other process counts, with --grad-accum keeping the "
               f"global batch of {cfg.batch_size * cfg.grad_accum * world})" if world > 1
               else f"seqlab train --out {args.out} --resume")
        if trainer.dist.is_main:
            print(f"[seqlab] stopped by {signal.Signals(result.signal).name} at step {result.step}; continue with "
                  f"{how}", file=sys.stderr)
        return 128 + result.signal
    return 0


def run_eval(args: argparse.Namespace) -> int:
    for flag, value in (("--batch-size", args.batch_size), ("--max-batches", args.max_batches)):
        if value is not None and value < 1:  # 0 batches would print loss 0 and perplexity 1 as if measured
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.json_out:
        check_writable_file(args.json_out, "--json")  # before the evaluation, which can take minutes
    res = evaluate_checkpoint(args.checkpoint, data=args.data, split=args.split, batch_size=args.batch_size,
                              max_batches=args.max_batches, device=args.device, precision=args.precision,
                              show_progress=args.progress, load_folder=_load_model_folder)
    for k in ("loss", "perplexity", "bits_per_token", "bits_per_byte", "n_targets", "n_bytes"):
        if k in res:
            v = res[k]
            print(f"{k:>15}: {v:.4f}" if isinstance(v, float) else f"{k:>15}: {v}")
    print(f"{'checkpoint':>15}: {res['checkpoint']} ({res['objective']}, {res['data']}, split={res['split']})")
    if args.json_out:
        atomic_write_text(Path(args.json_out), json.dumps(res, indent=2) + "\n")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    # named by the flag, before the corpus and tokenizer take their seconds (--samples 0: bits per byte only)
    if not (args.time > 0 and math.isfinite(args.time)):
        raise ValueError(f"--time must be a positive finite number of seconds, got {args.time}")
    if args.samples < 0 or args.max_new_tokens < 1:
        raise ValueError(f"--samples must be >= 0 and --max-new-tokens >= 1, got {args.samples} and "
                         f"{args.max_new_tokens}")
    overrides = {k: v for k, v in (("preset", args.preset), ("num_threads", args.num_threads),
                                   ("precision", args.precision)) if v is not None}
    s = demo(out_dir=args.out, train_seconds=args.time, seed=args.seed, samples=args.samples,
             max_new_tokens=args.max_new_tokens, progress=args.progress and sys.stderr.isatty(), **overrides)
    return 0 if s.get("val_bits_per_byte") is not None else 1
