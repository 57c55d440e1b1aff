"""A whole seqlab+accel training step with one piece switched between variants round by round, in one process.

Why one process and alternating rounds: the machine's slow phases then hit every variant alike, so the ratio of
the medians is the switched piece's share of the step alone. Shared by the benches of single training kernels
(``train_attention.py``, ``train_cross_entropy.py``).
"""
from __future__ import annotations

import argparse
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

import train_throughput
from seqlab.accel import accelerate
from seqlab.runtime.memory import keep_freed_blocks

# train_throughput's two model sizes (GPT-2 shape: learned positions, LayerNorm, GELU, tied head)
STEP_MODELS = {"d256": dict(vocab=8192, d_model=256, n_layers=4, n_heads=4),
               "gpt2-small": dict(vocab=50257, d_model=768, n_layers=12, n_heads=12)}


def accelerated_model(model_name: str) -> tuple[torch.nn.Module, types.SimpleNamespace]:
    """``train_throughput``'s seqlab model of that size, accelerated as ``seqlab train`` does on a CPU."""
    args = types.SimpleNamespace(**STEP_MODELS[model_name], seq_len=256, batch_size=8)
    model, _, _ = train_throughput.build_pair(args)
    accelerate(model, "train", rows=args.batch_size * args.seq_len, dtype=None, seq_len=args.seq_len)
    keep_freed_blocks()
    return model, args


def alternating_step_ms(model: torch.nn.Module, args, precision: str, rounds: int,
                        variants: dict[str, Callable[[], None]]) -> dict[str, float | list[float]]:
    """Median ms of a step (fused AdamW) under each variant (name -> a function that switches it on), the order
    reversed every other round; round 0 warms up every variant. Also the samples, as ``"<name> samples"``."""
    step = train_throughput.make_step("seqlab", model, precision, args.vocab, fused=True)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(2)]
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for r in range(rounds + 1):
        for name, switch_on in order if r % 2 else order[::-1]:
            switch_on()
            t0 = time.perf_counter()
            step(batches[r % 2])
            if r:
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {**{name: statistics.median(s) for name, s in samples.items()},
            **{f"{name} samples": s for name, s in samples.items()}}


def step_table(steps: list[dict], plain_key: str, plain_label: str) -> list[str]:
    """Markdown rows for :func:`alternating_step_ms` results: ``kernel_ms`` against ``steps[i][plain_key]``."""
    if not steps:
        return []
    return ["", f"| step | precision | kernel timed | calibration kept | with the kernel | with {plain_label} | "
            "speed-up |", "|---|---|---|---|---|---|---|"] + [
        f"| {s['model']} | {s['precision']} | {s.get('kernel', s.get('installed'))} | "
        f"{s.get('calibration_kept', 'kernel')} | {s['kernel_ms']:.1f} ms | {s[plain_key]:.1f} ms | "
        f"{s['speedup']:.3f}x |" for s in steps]


def add_step_options(ap: argparse.ArgumentParser, what: str) -> None:
    """``--step``, ``--step-rounds``, ``--step-precisions``, ``--threads`` and ``--out`` (for bench/results/<what>)."""
    ap.add_argument("--step", choices=sorted(STEP_MODELS), default=None,
                    help=f"also time a whole training step of this model with and without the {what} kernel")
    ap.add_argument("--step-rounds", type=int, default=8)
    ap.add_argument("--step-precisions", default="fp32,bf16", help="bf16 only where the CPU has it natively")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / f"train_{what}.json"))
