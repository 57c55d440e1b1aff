"""``seqlab demo`` (what ``make demo`` runs): the main job end to end in a few minutes on a laptop CPU.

1. train a byte-level BPE on the embedded Shakespeare corpus's training plays,
2. train a small causal LM on them for a fixed wall-clock budget (the cosine schedule is *time-based*, so it
   ends exactly when the budget does, however fast or busy the machine is),
3. evaluate bits per byte on the held-out play (Julius Caesar, never seen in training),
4. sample a few continuations with the generation engine, print a summary table, write ``summary.json``.

The recipe (model size, vocabulary, batch, learning rate) was tuned for 2 CPU cores; docs/training.md
records the sweep and the measured curve.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from seqlab.generate import generate
from seqlab.runtime.files import atomic_write_text
from seqlab.runtime.logbook import read_rows
from seqlab.runtime.rundir import claim_run_dir
from seqlab.train.config import TrainConfig
from seqlab.train.run import build_run
from seqlab.train.rundir import existing_run
from seqlab.train.trainer import Trainer

DEMO_PROMPTS = ("ROMEO.\n", "To be, or not to be", "KING. My lords,")

# The tuned recipe (see docs/training.md, "How the demo recipe was chosen").
DEMO_RECIPE: dict[str, Any] = dict(
    objective="clm", tokenizer="bpe:2048", preset="demo", seq_len=128, batch_size=16, grad_accum=1,
    lr=4e-3, min_lr_ratio=0.05, warmup_frac=0.03, weight_decay=0.1, grad_clip=1.0, precision="auto",
    eval_interval=0, ckpt_interval=0, keep_last=1, log_interval=20, max_steps=1_000_000,
)


def auto_threads() -> int:
    """All cores on an idle machine; fewer when other processes already keep cores busy.

    Intra-op parallel regions end in a barrier: when the machine is oversubscribed, a step waits for its slowest
    thread, which is often descheduled (docs/training.md has the measurement).
    """
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(cores, round(cores - busy)))


def demo_config(out_dir: str, train_seconds: float = 300.0, seed: int = 1337, **overrides: Any) -> TrainConfig:
    kw = dict(DEMO_RECIPE)
    kw.update(out_dir=out_dir, max_time_s=train_seconds, seed=seed, eval_interval_s=max(train_seconds / 6, 1.0),
              num_threads=auto_threads())
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**kw)


def sample_texts(model: torch.nn.Module, tokenizer, prompts: tuple[str, ...] | list[str], max_new_tokens: int = 120,
                 temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[dict[str, str]]:
    """Continue each prompt (sampling with temperature and top-k) using the generation engine."""
    model.eval()
    out = []
    for i, prompt in enumerate(prompts):
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []  # as every training document starts
        ids = torch.tensor([bos + tokenizer.encode(prompt)], dtype=torch.long, device=next(model.parameters()).device)
        room = model.config.max_seq_len - ids.shape[1]
        n_new = max(0, min(max_new_tokens, room))
        seq = _generate(model, ids, n_new, temperature, top_k, seed + i)
        out.append({"prompt": prompt, "completion": tokenizer.decode(seq[0, ids.shape[1]:].tolist())})
    return out


@torch.no_grad()
def _generate(model, ids, n_new, temperature, top_k, seed):
    return generate(model, ids, max_new_tokens=n_new, do_sample=True, temperature=temperature, top_k=top_k, seed=seed)


def run_demo(out_dir: str = "runs/demo", train_seconds: float = 300.0, seed: int = 1337, samples: int = 3,
             max_new_tokens: int = 120, progress: bool = True, **overrides: Any) -> dict[str, Any]:
    wall0 = time.perf_counter()
    cfg = demo_config(out_dir, train_seconds, seed, progress=progress, **overrides)
    out = Path(out_dir)
    # a demo always starts fresh; an earlier one is moved, not deleted
    moved = claim_run_dir(out, existing_run(out), overwrite=True)
    if moved is not None:
        print(f"[demo] the previous run in {out} was moved to {moved}")
    t = time.perf_counter()
    run = build_run(cfg)
    prep_s = time.perf_counter() - t
    n_params = run.model.num_parameters()
    print(f"[demo] tokenizer {run.tokenizer.vocab_size} tokens, {len(run.train_data)} train rows x {cfg.seq_len}, "
          f"model {n_params / 1e6:.2f} M params, budget {train_seconds:.0f} s of training ({prep_s:.1f} s to prepare)")
    trainer = Trainer(cfg, run.model, run.objective, run.train_data, run.val_data, tokenizer=run.tokenizer)
    result = trainer.fit()
    val = result.eval
    texts = sample_texts(trainer.raw_model, run.tokenizer, DEMO_PROMPTS[:samples], max_new_tokens, seed=seed)
    curve = [{"train_seconds": r["train_seconds"], "elapsed_s": r["elapsed_s"], "step": r["step"],
              "val_bpb": r["val_bpb"], "val_loss": r["val_loss"]}
             for r in read_rows(out / "metrics.jsonl") if r.get("val_bpb") is not None]
    summary = {
        "val_bits_per_byte": val.get("val_bpb"),
        "val_loss": val.get("val_loss"),
        "val_perplexity": val.get("val_ppl"),
        "train_seconds": result.train_seconds,
        "wall_seconds": time.perf_counter() - wall0,
        "tokens_seen": result.tokens_seen,
        "tokens_per_s": result.tokens_seen / max(result.train_seconds, 1e-9),
        "steps": result.step,
        "params": n_params,
        "precision": trainer.precision.name,
        "threads": torch.get_num_threads(),
        "tokenizer": {"spec": cfg.tokenizer, "vocab_size": run.tokenizer.vocab_size},
        "model_config": run.model.config.to_dict(),
        "train_config": cfg.to_dict(),
        "curve": curve,
        "checkpoint": result.checkpoint,
        "samples": texts,
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print_summary(summary)
    trainer.close()
    return summary


def print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("validation bits/byte", f"{s['val_bits_per_byte']:.3f}" if s["val_bits_per_byte"] is not None else "n/a"),
        ("validation loss (nats/token)", f"{s['val_loss']:.3f}" if s["val_loss"] is not None else "n/a"),
        ("training time", f"{s['train_seconds']:.1f} s ({s['steps']} steps, {s['precision']}, {s['threads']} threads)"),
        ("tokens seen", f"{s['tokens_seen']:,} ({s['tokens_per_s']:,.0f} tok/s)"),
        ("parameters", f"{s['params'] / 1e6:.2f} M"),
        ("wall time (all)", f"{s['wall_seconds']:.1f} s"),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n" + "=" * (w + 40))
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("=" * (w + 40))
    for smp in s["samples"]:
        print(f"--- {smp['prompt']!r}\n{smp['prompt']}{smp['completion']}\n")
