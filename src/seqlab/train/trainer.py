"""The Trainer: one optimizer step = all micro-batches of all ranks, normalised by the step's valid targets.

    for each step:
        micro-batches <- order (this rank's slice of the global batch)
        N <- sum over micro-batches and ranks of objective.num_targets(batch)      (one all-reduce)
        for each micro-batch:                                                     (grad sync on the last only)
            backward( loss_sum * world_size / N )   # DDP/FSDP average over ranks, hence world_size
        stop if the step loss is not finite (before the update: the weights stay good)
        clip; stop if the gradient norm is not finite (likewise; not under fp16, whose scaler skips such steps)
        optimizer step, lr from the schedule
        log / eval / checkpoint on their intervals (rank 0 writes; never weights that are not all finite)

The model never learns which objective it serves, and the Trainer never asks the objective's name: what differs
between objectives comes through the contract in ``objectives.base``. A resumed CPU fp32 run repeats the
uninterrupted run's losses exactly: everything it needs is in the checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, Sequence

import torch
from torch import nn

import seqlab.runtime.dist as D
import seqlab.train.checkpoint as ckpt
from seqlab.runtime.cpu import compile_keyed_by_isa
from seqlab.runtime.files import atomic_write_text
from seqlab.runtime.logbook import Logbook
from seqlab.runtime.progress import progress
from seqlab.runtime.rng import capture_rng, restore_rng
from seqlab.runtime.rundir import claim_run_dir
from seqlab.runtime.signals import GracefulStop
from seqlab.train.config import TrainConfig
from seqlab.train.distributed import (load_full_optimizer, load_full_weights, pooled_metrics, seed_rank_stream,
                                      set_grad_sync, share_tied, wrap_model)
from seqlab.train.evaluate import evaluate_on_ranks, to_device
from seqlab.train.guards import check_resume_steps, check_unchanged, non_finite_parameter, trainer_state
from seqlab.train.optim import build_optimizer
from seqlab.train.order import StepSampler
from seqlab.train.outcome import StopTraining, TrainingDiverged, TrainResult
from seqlab.train.precision import resolve_precision
from seqlab.train.report import draw_loss_curve, progress_postfix
from seqlab.train.recompute import enable_activation_checkpointing
from seqlab.train.run import keep_init_weights, kept_init_weights
from seqlab.train.rundir import existing_run
from seqlab.train.schedule import LRSchedule


# metrics.jsonl names of the pooled evaluation metrics (eval.metrics.EvalTotals.as_dict)
_VAL_NAMES = {"loss": "val_loss", "n_targets": "val_targets", "perplexity": "val_ppl", "bits_per_byte": "val_bpb",
              "n_bytes": "val_bytes"}


class Trainer:
    """Train ``model`` on ``objective`` over ``train_data`` (a map-style dataset of examples).

    ``train_data[i]`` returns one example that ``objective.collate`` understands; ``val_data`` likewise (optional).
    ``callbacks`` are called as ``cb(trainer, record)`` after every optimizer step; raising ``StopTraining``
    ends the run cleanly (no final checkpoint is written for a stopped run). Without ``resume`` the run
    directory must hold no earlier run: two runs never mix.
    """

    def __init__(self, cfg: TrainConfig, model: nn.Module, objective, train_data, val_data=None, tokenizer=None,
                 callbacks: Sequence[Callable] = (), resume: bool | str = False,
                 tensorboard_dir: str | os.PathLike | None = None):
        self.cfg = cfg
        self.objective = objective
        self.train_data, self.val_data = train_data, val_data
        self.tokenizer, self.callbacks = tokenizer, list(callbacks)
        self.out_dir = Path(cfg.out_dir)
        self.store = ckpt.store(self.out_dir / "checkpoints", cfg.keep_last)

        self.dist = D.init_distributed(device=cfg.device)
        self.device = self.dist.device
        D.set_cpu_threads(cfg.num_threads, self.dist)
        self.precision = resolve_precision(cfg.precision, self.device)
        self.scaler = self.precision.grad_scaler()

        self.raw_model = model.to(self.device)
        objective.setup(self.raw_model)  # e.g. DPO snapshots its frozen reference; before any resume load
        keep_init = (objective.uses_initial_model and cfg.init and self.dist.is_main
                     and kept_init_weights(self.out_dir) is None)
        initial = copy.deepcopy(model) if keep_init else None  # written once the run folder exists, then dropped
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.raw_model)
        self.model = wrap_model(self.raw_model, cfg.parallel, self.dist)
        self.fsdp = self.dist.active and cfg.parallel == "fsdp"
        self.optimizer = build_optimizer(self.raw_model, cfg)
        if cfg.compile:
            self.model = compile_keyed_by_isa(self.model)
        self.schedule = LRSchedule(cfg)
        self.sampler = StepSampler(len(train_data), cfg.batch_size, cfg.grad_accum, self.dist.rank,
                                   self.dist.world_size, cfg.seed)

        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.last_checkpoint: Path | None = None
        self.last_eval: dict[str, float] = {}
        self.last_eval_step: int | None = None

        if self.dist.rank:  # the model is built (the same on every rank): from here each rank draws its own dropout
            seed_rank_stream(cfg.seed, 0, self.dist)
        resume_path = self._find_resume(resume)
        if self.dist.is_main:
            if resume_path is None and not resume:
                claim_run_dir(self.out_dir, existing_run(self.out_dir))
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.store.clean_stale()
            if initial is not None:  # the reference's weights, kept with the run (train/run.py: keep_init_weights)
                keep_init_weights(initial, self.out_dir)
                del initial
        D.barrier(self.dist)
        if resume_path is not None:
            self.load(resume_path)
        self.logbook = Logbook(self.out_dir / "metrics.jsonl", resume_step=self.step if resume_path else None,
                               tensorboard_dir=tensorboard_dir, enabled=self.dist.is_main)
        if self.dist.is_main:
            self._write_run_files()
            for warning in cfg.warnings():
                print(f"[seqlab] warning: {warning}", file=sys.stderr)

    # ------------------------------------------------------------------------------------------------------
    def _find_resume(self, resume: bool | str) -> Path | None:
        if not resume or isinstance(resume, (str, os.PathLike)):
            return Path(resume) if resume else None
        latest = self.store.latest()
        if latest is None and self.dist.is_main:
            print(f"[seqlab] --resume: no checkpoint under {self.store.root}; starting from scratch")
        return latest

    def _model_config_dict(self) -> dict | None:
        mc = getattr(self.raw_model, "config", None)
        return mc.to_dict() if hasattr(mc, "to_dict") else None

    def _write_run_files(self) -> None:
        cfg_text = json.dumps({"train": self.cfg.to_dict(), "model": self._model_config_dict()}, indent=1, sort_keys=True)
        atomic_write_text(self.out_dir / "config.json", cfg_text + "\n")
        if self.tokenizer is not None and hasattr(self.tokenizer, "save"):
            self.tokenizer.save(self.out_dir / "tokenizer.json")

    # --- state ------------------------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint of the current step (collective: every rank must call it). Weights that are not all
        finite are refused (``TrainingDiverged``), so the "last good checkpoint" a message names is always good."""
        import torch.distributed.checkpoint.state_dict as sd_api  # heavy (seconds): only save/load need it

        bad = non_finite_parameter(self.raw_model)
        if D.any_rank(bad is not None, self.dist):
            raise TrainingDiverged(f"the weights after step {self.step} are not finite ({bad or 'on another rank'} "
                                   f"holds NaN or inf; lr={self.optimizer.param_groups[0]['lr']:.3g}); "
                                   f"training stopped without writing their checkpoint, {self._last_good()}")
        opts = sd_api.StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = share_tied(self.raw_model, sd_api.get_model_state_dict(self.raw_model, options=opts))
        optim_sd = sd_api.get_optimizer_state_dict(self.raw_model, self.optimizer, options=opts)
        rng_all = D.gather_bytes(json.dumps(capture_rng()).encode(), self.dist)
        path = None
        if self.dist.is_main:
            state = {
                "train_config": self.cfg.to_dict(),
                "model_config": self._model_config_dict(),
                "trainer": {"step": self.step, "tokens_seen": self.tokens_seen, "train_seconds": self.train_seconds,
                            "sampler": self.sampler.state_dict(), "world_size": self.dist.world_size},
                "rng": [json.loads(b) for b in rng_all],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "objective_state": self.objective.state_dict(),
                "data_state": self.train_data.state_dict() if hasattr(self.train_data, "state_dict") else None,
                "last_eval": self.last_eval,
                "last_eval_step": self.last_eval_step,
            }
            path = ckpt.save_checkpoint(self.store.root, self.step, model_sd, optim_sd, state, self.cfg.keep_last,
                                        extra_files=ckpt.model_folder_files(self._model_config_dict(), self.out_dir))
        self.last_checkpoint = self.store.path_for(self.step)  # on every rank: each names it when it stops
        D.barrier(self.dist)
        return path

    def load(self, path: Path) -> None:
        """Restore everything from a checkpoint directory (verifies file hashes first)."""
        state, model_sd, optim_sd = ckpt.load_checkpoint(path)
        tr, old = trainer_state(path, state), state.get("train_config", {})
        check_unchanged(path, old, self.cfg.to_dict(),
                        frozenset({"init"}) if self.objective.uses_initial_model else frozenset())
        warning = check_resume_steps(path, old, self.cfg, int(tr["step"]), float(tr["train_seconds"]))
        try:  # first of the restores: another number of processes must keep the global batch
            self.sampler.load_state_dict(tr["sampler"])
        except ValueError as e:
            raise ckpt.CheckpointError(f"{path}: {e}") from None
        load_full_weights(self.raw_model, model_sd, str(path))
        if optim_sd is not None:
            load_full_optimizer(self.raw_model, self.optimizer, optim_sd, str(path / "optimizer.safetensors"))
        self.step, self.tokens_seen, self.train_seconds = int(tr["step"]), int(tr["tokens_seen"]), float(tr["train_seconds"])
        rng = state.get("rng") or []
        if len(rng) == self.dist.world_size:
            restore_rng(rng[self.dist.rank])
        else:
            seed_rank_stream(self.cfg.seed, self.step, self.dist)
            if self.dist.is_main:
                print(f"[seqlab] checkpoint has RNG states for {len(rng)} ranks, this run has {self.dist.world_size}: "
                      "RNG streams are re-seeded (the run continues, but not bit-identically)")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("objective_state") is not None:
            self.objective.load_state_dict(state["objective_state"])
        if state.get("data_state") is not None and hasattr(self.train_data, "load_state_dict"):
            self.train_data.load_state_dict(state["data_state"])
        self.last_eval = state.get("last_eval") or {}
        self.last_eval_step = state.get("last_eval_step")
        self.last_checkpoint = Path(path)
        if self.dist.is_main:  # warned only now: a resume that a restore above refuses changes no schedule
            if warning:
                print(f"[seqlab] warning: {warning}", file=sys.stderr)
            print(f"[seqlab] resumed from {path} at step {self.step}")

    # --- the step ---------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's record (not yet logged)."""
        cfg, coll = self.cfg, self.dist.collective_device
        t_begin = time.perf_counter()
        self.model.train()
        micro = [self.objective.collate([self.train_data[i] for i in idx]) for idx in self.sampler.next_step()]
        micro = [to_device(b, self.device) for b in micro]
        counts = torch.tensor([sum(int(self.objective.num_targets(b)) for b in micro),
                               sum(self.objective.count_tokens(b) for b in micro)], dtype=torch.float64, device=coll)
        D.all_reduce_sum(counts, self.dist)
        n_targets, n_tokens = float(counts[0]), int(counts[1])
        if n_targets <= 0:
            raise RuntimeError(f"step {self.step + 1}: the global batch has no valid targets (every label is ignored; "
                               f"are the answers cut off by seq_len={cfg.seq_len}? try a larger --seq-len)")
        scale = self.dist.world_size / n_targets
        loss_sum = torch.zeros((), dtype=torch.float64, device=coll)
        metric_sums: dict[str, float] = {}
        metric_weights: dict[str, int] = {}
        for j, batch in enumerate(micro):
            with set_grad_sync(self.model, j == len(micro) - 1):
                with self.precision.autocast():
                    out = self.objective.loss(self.model, batch)
                loss = out.loss_sum.float() * scale
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += out.loss_sum.detach().to(loss_sum.device, torch.float64)
            for k, v in (out.metrics or {}).items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v) * out.weight(k)
                metric_weights[k] = metric_weights.get(k, 0) + out.weight(k)
        if self.fsdp:
            set_grad_sync(self.model, True)
        seconds = self.train_seconds  # under a time budget with this step's compute so far, by rank 0's clock:
        if cfg.max_time_s is not None:  # at progress 0 a warmup fraction's first update was lr / (max_steps + 1)
            seconds = D.broadcast_float(seconds + time.perf_counter() - t_begin, self.dist)
        lr = self.schedule.apply(self.optimizer, self.step, seconds)
        D.all_reduce_sum(loss_sum, self.dist)
        step_loss = float(loss_sum) / n_targets
        if not math.isfinite(step_loss):
            self._diverged(f"loss is {step_loss}", lr)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if self.scaler is None and not math.isfinite(float(grad_norm)):  # fp16: the scaler skips the step itself
            self._diverged(f"gradient norm is {float(grad_norm)}", lr, f"; the loss, {step_loss:.4g}, is finite")
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += n_tokens
        record = {"step": self.step, "loss": step_loss, "lr": lr, "grad_norm": float(grad_norm),
                  "n_targets": int(n_targets), "step_tokens": n_tokens}
        if metric_sums:
            record.update(pooled_metrics(metric_sums, metric_weights, self.dist, coll))
        return record

    def _last_good(self) -> str:
        """Where a stopped run can be resumed from, for the message of ``TrainingDiverged``."""
        return f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else \
            "no checkpoint was written yet"

    def _diverged(self, what: str, lr: float, note: str = "") -> NoReturn:
        """Stop before the update: drop the gradients and raise, naming the step and the last good checkpoint."""
        self.optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(f"{what} at step {self.step + 1} (lr={lr:.3g}{note}); training stopped before the "
                               f"update, {self._last_good()}")

    # --- evaluation -------------------------------------------------------------------------------------------
    def evaluate(self, data=None, max_batches: int | None = None) -> dict[str, float]:
        """Validation metrics over ``data`` (default: the validation set), pooled over all ranks exactly as
        ``seqlab eval`` pools them (``eval.metrics.EvalTotals``)."""
        data = self.val_data if data is None else data
        if data is None or len(data) == 0:
            return {}
        bs = self.cfg.eval_batch_size or self.cfg.batch_size
        totals = evaluate_on_ranks(self.model if self.fsdp else self.raw_model, self.objective, data, bs,
                                   max_batches or self.cfg.eval_batches, self.precision, self.dist, pad_ranks=self.fsdp)
        if totals.n_targets == 0:
            return {}
        return {_VAL_NAMES[k]: v for k, v in totals.as_dict(self.objective.token_level).items() if k in _VAL_NAMES}

    # --- the loop ---------------------------------------------------------------------------------------------
    def _done(self) -> bool:
        return self.step >= self.cfg.max_steps or self.schedule.progress(self.step, self.train_seconds) >= 1.0

    def _due(self, final: bool) -> tuple[bool, bool]:
        """(evaluate now, log now) after the step just taken."""
        cfg = self.cfg
        timed = cfg.eval_interval_s is not None and self.train_seconds >= self._next_timed_eval
        while timed and self._next_timed_eval <= self.train_seconds:
            self._next_timed_eval += cfg.eval_interval_s
        do_eval = self.val_data is not None and bool((cfg.eval_interval and self.step % cfg.eval_interval == 0)
                                                     or final or timed)
        return do_eval, do_eval or final or self.step == 1 or self.step % cfg.log_interval == 0

    def fit(self) -> TrainResult:
        """Train to the end of the schedule. A first SIGINT/SIGTERM finishes the step, checkpoints and returns
        (``result.signal`` says which); a second one raises ``KeyboardInterrupt`` at once."""
        cfg = self.cfg
        bar = progress(total=None if cfg.max_time_s is not None else cfg.max_steps, initial=self.step, unit="step",
                       desc="train", enabled=self.dist.is_main and cfg.progress)
        losses: list[float] = []
        last_loss: float | None = None
        window_tokens, window_time = 0, 0.0
        t_start = time.perf_counter()
        stopped, signal_stop = False, False
        if cfg.eval_interval_s is not None:
            self._next_timed_eval = (math.floor(self.train_seconds / cfg.eval_interval_s) + 1) * cfg.eval_interval_s
        with GracefulStop() as stop:
            try:
                while not self._done():
                    t0 = time.perf_counter()
                    record = self.train_step()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    dt = time.perf_counter() - t0
                    self.train_seconds += dt
                    if self.dist.active and (cfg.max_time_s is not None or cfg.eval_interval_s is not None):
                        self.train_seconds = D.broadcast_float(self.train_seconds, self.dist)
                    window_tokens += record["step_tokens"]
                    window_time += dt
                    last_loss = record["loss"]
                    losses.append(last_loss)
                    final = self._done()
                    do_eval, do_log = self._due(final)
                    if do_eval:
                        self.last_eval, self.last_eval_step = self.evaluate(), self.step
                        record.update(self.last_eval)
                    tok_s = window_tokens / max(window_time, 1e-9)
                    record.update(tokens_per_s=tok_s, tokens_seen=self.tokens_seen, train_seconds=self.train_seconds,
                                  elapsed_s=time.perf_counter() - t_start)
                    signal_stop = D.any_rank(stop.requested, self.dist)
                    if do_log or signal_stop:  # the step a signal stops at is logged, as its checkpoint is kept
                        self.logbook.append(record)
                        window_tokens, window_time = 0, 0.0
                    bar.set_postfix(progress_postfix(record, self.last_eval), refresh=False)
                    bar.update(1)
                    if signal_stop:
                        break
                    if cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0 and not final:
                        self.save()
                    try:
                        for cb in self.callbacks:
                            cb(self, record)
                    except StopTraining:  # on one rank alone the others waited in the next step's all-reduce
                        stopped = True
                    if self.callbacks and D.any_rank(stopped, self.dist):  # (every rank has the same callbacks)
                        stopped = True
                        break
            except StopTraining:
                stopped = True
            finally:
                bar.close()
                self.logbook.close()
            if not stopped:
                if self.last_checkpoint != self.store.path_for(self.step):
                    self.save()
                if self.dist.is_main and cfg.plot and not signal_stop:
                    draw_loss_curve(self.logbook, self.out_dir, self.objective.loss_label)
        return TrainResult(step=self.step, loss=last_loss, tokens_seen=self.tokens_seen,
                           train_seconds=self.train_seconds, eval=dict(self.last_eval), eval_step=self.last_eval_step,
                           checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None, losses=losses,
                           signal=int(stop.signum or signal.SIGTERM) if signal_stop else None)

    def close(self) -> None:
        D.shutdown(self.dist)
