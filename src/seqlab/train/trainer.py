"""The Trainer: one optimizer step = all micro-batches of all ranks, normalised by the step's valid targets.

    for each step:
        micro-batches <- sampler (this rank's slice of the global batch)
        N <- sum over micro-batches and ranks of objective.num_targets(batch)      (one all-reduce)
        for each micro-batch:                                                     (grad sync on the last only)
            backward( loss_sum * world_size / N )   # DDP/FSDP average over ranks, hence world_size
        stop if the step loss is not finite (before the update: the weights stay good)
        clip, optimizer step, lr from the schedule
        log / eval / checkpoint on their intervals (rank 0 writes)

The model never learns which objective it serves, and the objective never learns how many ranks there are:
the Trainer alone knows both. Everything a resumed run needs (weights, AdamW moments, step, data position, RNG
states of every rank, fp16 scaler) goes into the checkpoint, so a resumed CPU fp32 run repeats the uninterrupted
run's losses exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from seqlab.train import checkpoint as ckpt
from seqlab.train import distributed as D
from seqlab.train.config import RESUME_MUTABLE, TrainConfig
from seqlab.train.metrics_log import MetricsWriter, plot_loss_curve
from seqlab.train.optim import build_optimizer
from seqlab.train.precision import resolve_precision
from seqlab.train.recompute import enable_activation_checkpointing
from seqlab.train.sampler import StepSampler
from seqlab.train.schedule import LRSchedule


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the last good checkpoint."""


class StopTraining(Exception):
    """Raised by a callback to end ``fit`` early (tests use it to simulate a kill right after a checkpoint)."""


@dataclass
class TrainResult:
    step: int
    loss: float | None
    tokens_seen: int
    train_seconds: float
    eval: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    losses: list[float] = field(default_factory=list)  # per-step losses of this call (all steps, not just logged)


def _resolve_device(name: str, info: D.DistInfo) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", info.local_rank)
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", info.local_rank)
    return dev


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if device.type == "cpu":
        return batch
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _count_input_tokens(batch: dict[str, Any]) -> int:
    """Tokens the model processes in this batch (for tokens/s): real (unpadded) positions of every id tensor."""
    total = 0
    for key, mask_key in (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask"),
                          ("chosen_input_ids", "chosen_attention_mask"), ("rejected_input_ids", "rejected_attention_mask")):
        ids = batch.get(key)
        if isinstance(ids, torch.Tensor):
            mask = batch.get(mask_key)
            total += int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel()
    return total


class Trainer:
    """Train ``model`` on ``objective`` over ``train_data`` (a map-style dataset of examples).

    ``train_data[i]`` returns one example that ``objective.collate`` understands; ``val_data`` likewise (optional).
    ``callbacks`` are called as ``cb(trainer, record)`` after every optimizer step; raising ``StopTraining``
    ends the run cleanly (no final checkpoint is written for a stopped run).
    """

    def __init__(self, cfg: TrainConfig, model: nn.Module, objective, train_data, val_data=None, tokenizer=None,
                 callbacks: Sequence[Callable] = (), resume: bool | str = False):
        self.cfg = cfg
        self.objective = objective
        self.train_data, self.val_data = train_data, val_data
        self.tokenizer = tokenizer
        self.callbacks = list(callbacks)
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"

        self.dist = D.init_distributed("cuda" if cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu")
        self.device = _resolve_device(cfg.device, self.dist)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        elif self.dist.active and self.device.type == "cpu":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        self.precision = resolve_precision(cfg.precision, self.device)
        self.scaler = self.precision.grad_scaler()

        self.raw_model = model.to(self.device)
        if hasattr(objective, "setup"):  # e.g. DPO snapshots its frozen reference; before any resume load
            objective.setup(self.raw_model)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(self.raw_model)
        self.model = D.wrap_model(self.raw_model, cfg.parallel if self.dist.active else "none", self.dist, self.device)
        self.fsdp = self.dist.active and cfg.parallel == "fsdp"
        self.optimizer = build_optimizer(self.raw_model, cfg)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.schedule = LRSchedule(cfg)
        self.sampler = StepSampler(len(train_data), cfg.batch_size, cfg.grad_accum, self.dist.rank,
                                   self.dist.world_size, cfg.seed)
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", enabled=self.dist.is_main)

        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.last_checkpoint: Path | None = None
        self.last_eval: dict[str, float] = {}
        self._byte_table = None
        if tokenizer is not None and hasattr(tokenizer, "byte_lengths"):
            self._byte_table = torch.tensor(tokenizer.byte_lengths(), dtype=torch.long)

        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        resume_path = self._find_resume(resume)
        if resume_path is not None:
            self.load(resume_path)
        elif self.dist.is_main:
            self.metrics.reset()
        if self.dist.is_main:
            self._write_run_files()

    # ------------------------------------------------------------------------------------------------------
    def _find_resume(self, resume: bool | str) -> Path | None:
        if not resume:
            return None
        if isinstance(resume, (str, os.PathLike)) and not isinstance(resume, bool):
            return Path(resume)
        latest = ckpt.latest_checkpoint(self.ckpt_root)
        if latest is None and self.dist.is_main:
            print(f"[seqlab] --resume: no checkpoint under {self.ckpt_root}; starting from scratch")
        return latest

    def _write_run_files(self) -> None:
        cfg_text = json.dumps({"train": self.cfg.to_dict(), "model": self._model_config_dict()}, indent=1, sort_keys=True)
        ckpt.atomic_write_text(self.out_dir / "config.json", cfg_text + "\n")
        if self.tokenizer is not None and hasattr(self.tokenizer, "save"):
            self.tokenizer.save(self.out_dir / "tokenizer.json")

    def _model_config_dict(self) -> dict | None:
        mc = getattr(self.raw_model, "config", None)
        return mc.to_dict() if hasattr(mc, "to_dict") else None

    # --- state ------------------------------------------------------------------------------------------------
    def _model_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _optim_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.raw_model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (collective: every rank must call it)."""
        model_sd, optim_sd = self._model_state(), self._optim_state()
        rng_all = D.gather_bytes(json.dumps(ckpt.capture_rng()).encode(), self.dist, self._coll_device)
        path = None
        if self.dist.is_main:
            state = {
                "train_config": self.cfg.to_dict(),
                "model_config": self._model_config_dict(),
                "trainer": {"step": self.step, "tokens_seen": self.tokens_seen, "train_seconds": self.train_seconds,
                            "sampler": self.sampler.state_dict(), "world_size": self.dist.world_size},
                "rng": [json.loads(b) for b in rng_all],
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "objective_state": self._component_state(self.objective),
                "data_state": self._component_state(self.train_data),
                "last_eval": self.last_eval,
            }
            extra = {}
            if self._model_config_dict() is not None:  # the seqlab.io model format: load_pretrained(ckpt_dir) works
                import seqlab

                doc = {"format": "seqlab", "seqlab_version": seqlab.__version__, "config": self._model_config_dict()}
                extra["config.json"] = (json.dumps(doc, indent=2) + "\n").encode()
            for name in ("tokenizer.json", "tokenizer_config.json"):  # the config keeps the chat template
                if (self.out_dir / name).is_file():
                    extra[name] = (self.out_dir / name).read_bytes()
            path = ckpt.save_checkpoint(self.ckpt_root, self.step, model_sd, optim_sd, state, self.cfg.keep_last,
                                        extra_files=extra)
            self.last_checkpoint = path
        D.barrier(self.dist)
        return path

    @staticmethod
    def _component_state(obj) -> Any:
        fn = getattr(obj, "state_dict", None)
        if callable(fn) and not isinstance(obj, nn.Module):
            return fn()
        return None

    def load(self, path: Path) -> None:
        """Restore everything from a checkpoint directory (verifies file hashes first)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        state, model_sd, optim_sd = ckpt.load_checkpoint(path)
        old = state.get("train_config", {})
        new = self.cfg.to_dict()
        diffs = sorted(k for k in new if k not in RESUME_MUTABLE and k in old and old[k] != new[k])
        if diffs:
            detail = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in diffs)
            raise ckpt.CheckpointError(f"{path}: cannot resume, the run configuration changed ({detail})")
        opts = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.raw_model, model_sd, options=opts)
        if optim_sd is not None:
            set_optimizer_state_dict(self.raw_model, self.optimizer, optim_sd, options=opts)
        tr = state["trainer"]
        self.step, self.tokens_seen, self.train_seconds = int(tr["step"]), int(tr["tokens_seen"]), float(tr["train_seconds"])
        self.sampler.load_state_dict(tr["sampler"])
        rng = state.get("rng") or []
        if len(rng) == self.dist.world_size:
            ckpt.restore_rng(rng[self.dist.rank])
        elif self.dist.is_main:
            print(f"[seqlab] checkpoint has RNG states for {len(rng)} ranks, this run has {self.dist.world_size}: "
                  "RNG streams are re-seeded (the run continues, but not bit-identically)")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        for obj, key in ((self.objective, "objective_state"), (self.train_data, "data_state")):
            if state.get(key) is not None and hasattr(obj, "load_state_dict") and not isinstance(obj, nn.Module):
                obj.load_state_dict(state[key])
        self.last_eval = state.get("last_eval") or {}
        self.last_checkpoint = Path(path)
        if self.dist.is_main:
            self.metrics.truncate_after(self.step)
            print(f"[seqlab] resumed from {path} at step {self.step}")

    # --- the step ---------------------------------------------------------------------------------------------
    @property
    def _coll_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns the step's record (not yet logged)."""
        cfg = self.cfg
        self.model.train()
        micro = [self.objective.collate([self.train_data[i] for i in idx]) for idx in self.sampler.next_step()]
        micro = [_to_device(b, self.device) for b in micro]
        counts = torch.tensor([sum(int(self.objective.num_targets(b)) for b in micro),
                               sum(_count_input_tokens(b) for b in micro)], dtype=torch.float64, device=self._coll_device)
        D.all_reduce_sum(counts, self.dist)
        n_targets, n_tokens = float(counts[0]), int(counts[1])
        if n_targets <= 0:
            raise RuntimeError(f"step {self.step + 1}: the global batch has no valid targets (every label is ignored; "
                               f"are the answers cut off by seq_len={cfg.seq_len}? try a larger --seq-len)")
        lr = self.schedule(self.step, self.train_seconds)
        self._set_lr(lr)
        scale = self.dist.world_size / n_targets
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._coll_device)
        metric_sums: dict[str, float] = {}
        for j, batch in enumerate(micro):
            last = j == len(micro) - 1
            with D.set_grad_sync(self.model, last):
                with self.precision.autocast():
                    out = self.objective.loss(self.model, batch)
                loss = out.loss_sum.float() * scale
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += out.loss_sum.detach().to(loss_sum.device, torch.float64)
            for k, v in (out.metrics or {}).items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v) * out.n_targets
        if self.fsdp:
            D.set_grad_sync(self.model, True)
        D.all_reduce_sum(loss_sum, self.dist)
        step_loss = float(loss_sum) / n_targets
        if not math.isfinite(step_loss):
            self.optimizer.zero_grad(set_to_none=True)
            where = f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint was written yet"
            raise TrainingDiverged(f"loss is {step_loss} at step {self.step + 1} (lr={lr:.3g}); training stopped before "
                                   f"the update, {where}")
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
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
        if metric_sums and not self.dist.active:
            record.update({k: v / max(n_targets, 1) for k, v in metric_sums.items()})
        return record

    # --- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data=None, max_batches: int | None = None) -> dict[str, float]:
        """Loss per target, perplexity and bits per byte over ``data`` (default: the validation set), all ranks."""
        data = self.val_data if data is None else data
        if data is None or len(data) == 0:
            return {}
        model = self.model if self.fsdp else self.raw_model
        was_training = model.training
        model.eval()
        bs = self.cfg.eval_batch_size or self.cfg.batch_size
        starts = list(range(0, len(data), bs))
        if max_batches is None:
            max_batches = self.cfg.eval_batches
        if max_batches is not None:
            starts = starts[:max_batches]
        mine = starts[self.dist.rank::self.dist.world_size]
        if self.fsdp:  # every rank must run the same number of forwards (they all-gather weights)
            n_max = math.ceil(len(starts) / self.dist.world_size)
            mine = mine + [None] * (n_max - len(mine))
        sums = torch.zeros(4, dtype=torch.float64, device=self._coll_device)  # loss, targets, bytes, has_bytes
        # MLM: the same evaluation masks every time, without moving the training RNG stream
        scope = self.objective.evaluating() if hasattr(self.objective, "evaluating") else contextlib.nullcontext()
        with scope:
            for s in mine:
                real = s is not None
                s = s if real else starts[0]
                rows = [data[i] for i in range(s, min(s + bs, len(data)))]
                batch = _to_device(self.objective.collate(rows), self.device)
                with self.precision.autocast():
                    out = self.objective.loss(model, batch)
                if not real:
                    continue
                n_bytes = out.n_bytes
                if n_bytes is None and self._byte_table is not None and isinstance(batch.get("labels"), torch.Tensor):
                    from seqlab.objectives.loss import count_bytes

                    n_bytes = count_bytes(batch["labels"], self._byte_table)
                sums += torch.tensor([float(out.loss_sum), out.n_targets, n_bytes or 0, n_bytes is not None],
                                     dtype=torch.float64, device=sums.device)
        D.all_reduce_sum(sums, self.dist)
        model.train(was_training)
        loss_sum, n, n_bytes, has_bytes = (float(x) for x in sums)
        if n == 0:
            return {}
        res = {"val_loss": loss_sum / n, "val_targets": int(n)}
        if self.objective.name == "dpo":  # a per-pair preference loss: perplexity and bits per byte mean nothing
            return res
        res["val_ppl"] = math.exp(min(loss_sum / n, 50.0))
        if has_bytes and n_bytes > 0:
            res["val_bpb"] = loss_sum / (math.log(2) * n_bytes)
            res["val_bytes"] = int(n_bytes)
        return res

    # --- the loop ---------------------------------------------------------------------------------------------
    def _done(self) -> bool:
        return self.step >= self.cfg.max_steps or self.schedule.progress(self.step, self.train_seconds) >= 1.0

    def fit(self) -> TrainResult:
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(total=None if cfg.max_time_s is not None else cfg.max_steps, initial=self.step, unit="step", disable=not (self.dist.is_main and cfg.progress),
                   dynamic_ncols=True, desc="train")
        losses: list[float] = []
        last_loss: float | None = None
        window_tokens, window_time = 0, 0.0
        t_start = time.perf_counter()
        stopped = False
        if cfg.eval_interval_s is not None:
            self._next_timed_eval = (math.floor(self.train_seconds / cfg.eval_interval_s) + 1) * cfg.eval_interval_s
        try:
            while not self._done():
                t0 = time.perf_counter()
                record = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t0
                self.train_seconds += dt
                if self.dist.active and (cfg.max_time_s is not None or cfg.eval_interval_s is not None):
                    self.train_seconds = D.broadcast_float(self.train_seconds, self.dist, self._coll_device)
                window_tokens += record["step_tokens"]
                window_time += dt
                last_loss = record["loss"]
                losses.append(last_loss)
                final = self._done()
                timed = cfg.eval_interval_s is not None and self.train_seconds >= self._next_timed_eval
                if timed:
                    while self._next_timed_eval <= self.train_seconds:
                        self._next_timed_eval += cfg.eval_interval_s
                do_eval = self.val_data is not None and (
                    (cfg.eval_interval and self.step % cfg.eval_interval == 0) or final or timed)
                do_log = self.step % cfg.log_interval == 0 or do_eval or final or self.step == 1
                if do_eval:
                    self.last_eval = self.evaluate()
                    record.update(self.last_eval)
                tok_s = window_tokens / max(window_time, 1e-9)
                record.update(tokens_per_s=tok_s, tokens_seen=self.tokens_seen, train_seconds=self.train_seconds,
                              elapsed_s=time.perf_counter() - t_start)
                if do_log:
                    self.metrics.write(record)
                    window_tokens, window_time = 0, 0.0
                post = {"loss": f"{last_loss:.4f}", "lr": f"{record['lr']:.2e}", "tok/s": f"{tok_s:,.0f}"}
                if "val_bpb" in self.last_eval:
                    post["val_bpb"] = f"{self.last_eval['val_bpb']:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
                if cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0 and not final:
                    self.save()
                for cb in self.callbacks:
                    cb(self, record)
        except StopTraining:
            stopped = True
        finally:
            bar.close()
            self.metrics.close()
        if not stopped:
            if self.last_checkpoint is None or ckpt.checkpoint_dir(self.ckpt_root, self.step) != self.last_checkpoint:
                self.save()
            if self.dist.is_main and cfg.plot:
                try:
                    plot_loss_curve(self.out_dir / "metrics.jsonl", self.out_dir / "loss_curve.png")
                except Exception as e:  # a plotting problem must not lose a finished run
                    print(f"[seqlab] could not draw the loss curve: {e}")
        return TrainResult(step=self.step, loss=last_loss, tokens_seen=self.tokens_seen,
                           train_seconds=self.train_seconds, eval=dict(self.last_eval),
                           checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None, losses=losses)

    def close(self) -> None:
        D.shutdown(self.dist)
