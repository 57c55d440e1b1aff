"""What ``seqlab nnqs`` refuses in its flags before the SCF: impossible values, and a ``--resume``
whose flags differ from its checkpoint's.

Why the second: the references (SCF, CCSD, FCI) and the warm-start target come before the driver's own comparison
of the run's settings (``nnqs.resume.check_same_run``), and on the larger molecules they take minutes. The flags fix
most of the settings by themselves, so a resume whose flags differ from its checkpoint's is refused here, at once,
in the same words; the settings that follow from the references (the warm start actually made, and the recipe's
values for the flags left out) are still compared by the driver.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from seqlab.nnqs.ansatz import AnsatzConfig
from seqlab.nnqs.recipe import default_samples
from seqlab.nnqs.resume import check_same_run
from seqlab.nnqs.vmc_config import VMCConfig
from seqlab.nnqs.vmc_checkpoint import checkpoint_store
from seqlab.runtime.errors import CheckpointError

# flags whose left-out value is the recipe's, known only once the warm start is made: compared only when given
RECIPE_FILLED = {"lr": "lr", "warmup": "warmup", "anneal": "anneal", "min_lr_ratio": "min_lr_ratio",
                 "phase_lr_scale": "phase_lr_scale", "rollback_tol_mha": "rollback_tol",
                 "rollback_after": "rollback_after", "selected_sign_fit": "selected_sign_fit",
                 "lbfgs_steps": "lbfgs_steps"}


def ansatz_of(args: argparse.Namespace) -> AnsatzConfig:
    """The wavefunction's shape the flags ask for."""
    return AnsatzConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                        phase_hidden=args.phase_hidden, phase_layers=args.phase_layers)


def flag_settings(args: argparse.Namespace, n_configurations: int, steps: int | None) -> dict[str, Any]:
    """The VMC settings (as state.json records them) that the flags fix before the references are computed."""
    samples = args.samples and int(args.samples)
    settings: dict[str, Any] = {
        "samples": samples or default_samples(n_configurations, VMCConfig.sector_max, args.estimator),
        "samples_final": None if args.samples_final is None else int(args.samples_final),
        "local_energy": args.local_energy, "estimator": args.estimator, "exact_tail": args.exact_tail,
        "exact_max_configs": args.exact_max_configs, "selected_expand": args.selected_expand,
        "selected_pin_warm_start": args.pin_warm_start, "lbfgs_iters": args.lbfgs_iters, "sr": args.sr,
        "seed": args.seed, "sampler": {"use_cache": not args.no_cache, "max_batch": args.max_batch}}
    settings.update({field: getattr(args, flag) for field, flag in RECIPE_FILLED.items()
                     if getattr(args, flag) is not None})
    if args.beta2 is not None:
        settings["betas"] = [VMCConfig.betas[0], args.beta2]
    if steps is not None:
        settings["steps"] = steps
    return settings


def check_resume_flags(args: argparse.Namespace, out: Path, n_orb: int, n_alpha: int, n_beta: int,
                       n_configurations: int) -> None:
    """Refuse ``--resume`` into ``out`` when its latest checkpoint is for another orbital and electron count, or
    when a flag differs from the setting it recorded (the driver compares the rest after the references)."""
    store = checkpoint_store(out, None)
    latest = store.latest()
    if latest is None:
        return
    saved = store.read_state(latest)
    where = latest / "state.json"
    found = (saved.get("n_orb"), saved.get("n_alpha"), saved.get("n_beta"))
    if found != (n_orb, n_alpha, n_beta):
        raise CheckpointError(f"{where}: cannot resume, the checkpoint is for another molecule or basis: (orbitals, "
                              f"N_alpha, N_beta) = {found}, not {(n_orb, n_alpha, n_beta)}")
    steps = args.steps or saved.get("vmc", {}).get("steps")
    # the method made and its size follow from the references (CCSD may fall back to CASCI, an open shell to none);
    # only "none" is "none" whatever they say
    start: dict[str, Any] = {"steps": args.warm_start_steps, "phase_weight": args.warm_start_phase_weight}
    if args.warm_start == "none":
        start = {"method": "none"}
    check_same_run(where, saved, flag_settings(args, n_configurations, steps), start, asdict(ansatz_of(args)))


def _sample_count(flag: str, value: float | None) -> int | None:
    """A sample count flag as an integer: positive, whole, and at most 2^53 (float64 counts stay exact)."""
    if value is None:
        return None
    n = int(value) if value == value and abs(value) != float("inf") else 0
    if n != value or not 1 <= n <= 2**53:
        raise ValueError(f"{flag} must be a positive integer of at most 2^53, got {value:g}")
    return n


def check_flags(args: argparse.Namespace) -> int | None:
    """Refuse impossible numbers before any work starts; returns N_s as an integer (None: by the sector's size)."""
    samples, final = (_sample_count(flag, value) for flag, value in (("--samples", args.samples),
                                                                      ("--samples-final", args.samples_final)))
    if samples is not None and final is not None and final < samples:
        raise ValueError(f"--samples-final must be >= --samples ({samples:g}): the ramp grows, got {final:g}")
    if args.lbfgs_steps and args.estimator == "sampled":  # (auto decides by the sector's size, known later)
        raise ValueError("--lbfgs-steps needs a summed energy (--estimator exact-sum or selected-sum), not samples")
    for flag, value, low in (("--warmup", args.warmup, 0), ("--anneal", args.anneal, 0), ("--steps", args.steps, 1),
                             ("--max-batch", args.max_batch, 1), ("--checkpoint-every", args.checkpoint_every, 1),
                             ("--threads", args.threads, 1), ("--warm-start-steps", args.warm_start_steps, 0),
                             ("--warm-start-max-configs", args.warm_start_max_configs, 1),
                             ("--rollback-tol", args.rollback_tol, 0), ("--rollback-after", args.rollback_after, 0),
                             ("--selected-expand", args.selected_expand, 0),
                             ("--selected-sign-fit", args.selected_sign_fit, 0),
                             ("--lbfgs-steps", args.lbfgs_steps, 0), ("--lbfgs-iters", args.lbfgs_iters, 1),
                             ("--d-model", args.d_model, 1), ("--layers", args.layers, 1), ("--heads", args.heads, 1),
                             ("--phase-hidden", args.phase_hidden, 1), ("--phase-layers", args.phase_layers, 1)):
        if value is not None and not value >= low:  # `not >=` also catches NaN
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.d_model is not None and args.heads is not None and args.d_model % args.heads:  # before the chemistry
        raise ValueError(f"--heads {args.heads} must divide --d-model {args.d_model} (each head takes an equal share)")
    for flag, value, ok, want in (("--lr", args.lr, lambda v: v > 0, "> 0"),
                                  ("--min-lr-ratio", args.min_lr_ratio, lambda v: 0 < v <= 1, "in (0, 1]"),
                                  ("--phase-lr-scale", args.phase_lr_scale, lambda v: v > 0, "> 0"),
                                  ("--beta2", args.beta2, lambda v: 0 < v < 1, "in (0, 1)")):
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {want}, got {value}")
    if args.estimator in ("exact-sum", "selected-sum") and args.local_energy != "exact":
        raise ValueError(f"--estimator {args.estimator} sums H psi exactly: it takes --local-energy exact, not "
                         f"{args.local_energy}")
    if not 0 <= args.exact_tail < 1:
        raise ValueError(f"--exact-tail must be in [0, 1), got {args.exact_tail}")
    if not args.exact_max_configs >= 1:
        raise ValueError(f"--exact-max-configs must be >= 1, got {args.exact_max_configs}")
    return samples
