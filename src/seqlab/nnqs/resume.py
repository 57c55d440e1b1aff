"""What a resumed NNQS run keeps of the run it continues: its settings, its warm-start record and its time so far.

Why: ``--resume`` promises to continue the run bit for bit, and result.json reports the run's recipe. A resume with
another learning rate, estimator, seed or start would continue a different run under the old one's name, and
result.json would report the new values (and a null warm start, which reads as a random start) as if they had held
throughout. So every setting that changes what a step computes is compared with the checkpoint's and a change is
refused, naming each field with its old and new value; only ``RESUME_MUTABLE`` may differ (more steps, checkpoint
spacing). The warm-start fit's record and the time spent so far travel in the checkpoint, so the result of a
resumed run describes the whole run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from seqlab.nnqs.vmc_config import VMCConfig
from seqlab.nnqs.warm_start import TargetState, WarmStartConfig
from seqlab.runtime.errors import CheckpointError

# settings that cannot change the steps already taken: more steps (fewer are refused by the driver, and the cosine is
# re-stretched over the new count, as documented) and where checkpoints fall
RESUME_MUTABLE = frozenset({"steps", "checkpoint_every", "keep_last"})
CLOCKS = ("wall_s", "cpu_s", "vmc_s")  # the whole invocation's wall and CPU time, and the time inside run_vmc
# the ``seqlab nnqs`` flag behind each recorded setting, so a refusal names what the user typed as well as the field
FLAGS = {"samples": "--samples", "samples_final": "--samples-final", "lr": "--lr", "warmup": "--warmup",
         "min_lr_ratio": "--min-lr-ratio", "phase_lr_scale": "--phase-lr-scale", "betas": "--beta2",
         "local_energy": "--local-energy", "estimator": "--estimator", "exact_tail": "--exact-tail",
         "exact_max_configs": "--exact-max-configs", "selected_expand": "--selected-expand",
         "selected_pin_warm_start": "--pin-warm-start", "selected_sign_fit": "--selected-sign-fit",
         "lbfgs_steps": "--lbfgs-steps", "lbfgs_iters": "--lbfgs-iters", "anneal": "--anneal", "sr": "--sr",
         "seed": "--seed", "rollback_tol_mha": "--rollback-tol", "rollback_after": "--rollback-after",
         "sampler.use_cache": "--no-cache", "sampler.max_batch": "--max-batch", "warm_start.method": "--warm-start",
         "warm_start.n_configs": "--warm-start-max-configs", "warm_start.steps": "--warm-start-steps",
         "warm_start.phase_weight": "--warm-start-phase-weight", "ansatz.d_model": "--d-model",
         "ansatz.n_layers": "--layers", "ansatz.n_heads": "--heads", "ansatz.phase_hidden": "--phase-hidden",
         "ansatz.phase_layers": "--phase-layers"}


def vmc_settings(cfg: VMCConfig) -> dict[str, Any]:
    """``cfg`` as JSON data, as a checkpoint's state.json records it (``vmc``)."""
    return json.loads(json.dumps(asdict(cfg), default=str))


def start_settings(target: TargetState | None, fit_cfg: WarmStartConfig | None) -> dict[str, Any]:
    """How the run started, as a checkpoint records it (``start``): the warm-start state's method and size and the
    fit's settings, or the random start. ``fit_cfg.method`` is not one of them: the target's method is what ran."""
    if target is None:
        return {"method": "none"}
    fit = {k: v for k, v in asdict(fit_cfg or WarmStartConfig()).items() if k != "method"}
    return {"method": target.method, "n_configs": len(target.keys), **fit}


def _flat(prefix: str, settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flat(f"{prefix}{key}.", value))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_run(where: Path, saved: dict[str, Any], vmc: dict[str, Any], start: dict[str, Any],
                   ansatz: dict[str, Any] | None = None) -> None:
    """Refuse to resume the checkpoint whose state.json is ``saved`` (at ``where``) with other settings than it
    recorded, naming every changed field with its flag (``--flag (field): old -> new``). ``lbfgs_steps`` may change
    with ``steps`` as long as the L-BFGS steps begin at the same step (the CLI's default: all of them). Only the
    fields given are compared, so the CLI checks the flags it can before any molecule is built; fields a checkpoint
    of an earlier version did not record are not compared either."""
    old = {**_flat("", saved.get("vmc", {})), **_flat("warm_start.", saved.get("start", {})),
           **_flat("ansatz.", saved.get("ansatz") or {})}
    new = {**_flat("", vmc), **_flat("warm_start.", start), **_flat("ansatz.", ansatz or {})}
    changed = [k for k in new if k in old and old[k] != new[k] and k not in RESUME_MUTABLE]
    if "lbfgs_steps" in changed and {"steps", "lbfgs_steps"} <= old.keys() and "steps" in new and (
            old["steps"] - old["lbfgs_steps"] == new["steps"] - new["lbfgs_steps"]):
        changed.remove("lbfgs_steps")
    if changed:
        detail = ", ".join(f"{FLAGS[k] + ' (' + k + ')' if k in FLAGS else k}: {old[k]!r} -> {new[k]!r}"
                           for k in changed)
        raise CheckpointError(f"{where}: cannot resume, the run's settings changed ({detail}); resume with the "
                              f"options it was started with, or start a new run with another --out")


def elapsed_before(saved: dict[str, Any] | None) -> dict[str, float]:
    """The time a checkpoint records for the run up to it (zeros for a fresh run or an earlier version's
    checkpoint, which recorded none)."""
    recorded = (saved or {}).get("elapsed") or {}
    return {k: float(recorded.get(k, 0.0)) for k in CLOCKS}


def elapsed_now(before: dict[str, float], started: tuple[float, float], vmc_started: float) -> dict[str, float]:
    """``before`` plus this invocation's time: wall and CPU since ``started`` (``time.perf_counter()``,
    ``time.process_time()``), and the wall time since ``vmc_started``."""
    now = time.perf_counter()
    return {"wall_s": before["wall_s"] + now - started[0],
            "cpu_s": before["cpu_s"] + time.process_time() - started[1],
            "vmc_s": before["vmc_s"] + now - vmc_started}
