"""VMC checkpoints on the runtime's store, and the files that make a folder an NNQS run.

One checkpoint is ``OUT/checkpoints/step_XXXXXXXX/`` with model.safetensors, optimizer.safetensors (AdamW moments
and step count as tensors, never a pickle) and state.json (step, annealing T0, RNG state, configs, how the run
started and its time so far, sha256 of each file), for the selected sum its space S (keys and H elements), and for
L-BFGS steps the optimiser's history. The store writes it under a temporary name and renames it once, so a kill at
any moment leaves the previous checkpoint or the new one, never a model one step ahead of its optimizer. Everything
a step depends on is in it, so a resumed run continues bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.lbfgs import lbfgs_state, load_lbfgs_state
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.step_guard import GuardedState, StepGuard
from seqlab.runtime.errors import CheckpointError
from seqlab.runtime.rng import capture_rng, restore_rng
from seqlab.runtime.rundir import first_existing, refuse_run
from seqlab.runtime.store import CheckpointStore, load_optimizer_state, optimizer_dict_from_tensors, \
    optimizer_dict_to_tensors, optimizer_state_to_tensors

KIND = "seqlab-nnqs-checkpoint"
CHECKPOINTS = "checkpoints"
LEGACY_CHECKPOINT = "checkpoint"  # the non-atomic layout of earlier versions (model, optimizer.pt, state.json)
LOG = "energies.jsonl"
ORBITAL_TOL = 1e-6  # the SCF converges to ~1e-10; a rotated or re-signed orbital changes entries by O(0.1)
FINGERPRINT_SEED = 20261203
RUN_FILES = (LOG, "result.json", "convergence.png", "error.png")


def checkpoint_store(out: Path, keep_last: int | None) -> CheckpointStore:
    return CheckpointStore(out / CHECKPOINTS, keep_last, kind=KIND)


def orbital_fingerprint(ham: Hamiltonian) -> dict[str, torch.Tensor]:
    """h1 and four random rank-1 projections of (pq|rs): they change when orbitals are rotated or re-signed. h1
    alone misses a rotation inside a degenerate block (it is a multiple of 1 there); the projections do not."""
    n = ham.n_orb
    vectors = np.random.default_rng(FINGERPRINT_SEED).standard_normal((4, 4, n))
    projections = [np.einsum("pqrs,p,q,r,s->", ham.eri, *v) for v in vectors]
    return {"h1": torch.from_numpy(ham.h1.copy()), "eri_projections": torch.tensor(projections, dtype=torch.float64)}


def check_orbitals(where: Path, saved: dict[str, torch.Tensor] | None, ham: Hamiltonian) -> None:
    """Refuse a checkpoint trained on other orbitals (another basis, geometry, or an orbital convention of an
    earlier version): its wavefunction would be read in the wrong basis and start far from where it stopped."""
    if saved is None:  # checkpoints of earlier versions carry no fingerprint
        return
    for name, now in orbital_fingerprint(ham).items():
        before = saved.get(name)
        if before is None or before.shape != now.shape:
            raise CheckpointError(f"{where}: the checkpoint was trained on another molecule ({name} differs in shape)")
        diff = float(((before - now).abs() / now.abs().clamp_min(1.0)).max())
        if diff > ORBITAL_TOL:
            raise CheckpointError(f"{where}: the checkpoint was trained in other molecular orbitals ({name} differs by "
                                  f"{diff:.3g}, relative); start a new run with another --out")


def save_checkpoint(store: CheckpointStore, wf: Wavefunction, opt: torch.optim.Optimizer, step: int, t0: float,
                    vmc: dict[str, Any], guard: StepGuard | None = None, ham: Hamiltonian | None = None,
                    selected: SelectedSpace | None = None, lbfgs: torch.optim.LBFGS | None = None,
                    run: dict[str, Any] | None = None) -> Path:
    """Checkpoint after ``step`` completed steps (call on the main rank only), with the step guard's best state, the
    orbital fingerprint of ``ham``, the selected space, the L-BFGS history and ``run`` (JSON data for state.json:
    how the run started and its time so far, ``resume.py``)."""
    opt_tensors, opt_meta = optimizer_state_to_tensors(opt)
    state = {**wf.config_dict(), **(run or {}), "t0": t0, "vmc": vmc, "optimizer": opt_meta, "rng": capture_rng()}
    tensors = {"model": dict(wf.state_dict()), "optimizer": opt_tensors}
    if ham is not None:
        tensors["orbitals"] = orbital_fingerprint(ham)
    if selected is not None:
        tensors["selected"] = selected.state()
    if lbfgs is not None:
        tensors["lbfgs"], state["lbfgs"] = lbfgs_state(lbfgs)
    if guard is not None:
        state["guard"] = guard.state()
        if guard.best is not None:
            tensors["best_model"] = guard.best.model
            tensors["best_optimizer"], state["best_optimizer"] = optimizer_dict_to_tensors(guard.best.optimizer)
    return store.save(step, tensors, state)


def load_checkpoint(store: CheckpointStore, path: Path, wf: Wavefunction, opt: torch.optim.Optimizer,
                    guard: StepGuard | None = None, ham: Hamiltonian | None = None,
                    selected: SelectedSpace | None = None,
                    lbfgs: torch.optim.LBFGS | None = None) -> tuple[int, float, bool]:
    """Restore model, optimizer, RNG (and the guard's best state, the selected space and the L-BFGS history; those of
    earlier versions have none, and start it empty) from ``path``
    (sha256-verified), after checking it was trained on ``ham``'s orbitals; returns (completed steps, T0, whether
    the checkpoint held a selected space: those of earlier versions did not)."""
    tensors, state = store.load(path)
    where = path / "state.json"
    found = (state.get("n_orb"), state.get("n_alpha"), state.get("n_beta"))
    if found != (wf.n_orb, wf.n_alpha, wf.n_beta):
        raise CheckpointError(f"{where}: checkpoint is for a different molecule (n_orb, N_alpha, N_beta) = {found}, "
                              f"not {(wf.n_orb, wf.n_alpha, wf.n_beta)}")
    if ham is not None:
        check_orbitals(path, tensors.get("orbitals"), ham)
    if state.get("ansatz") != asdict(wf.cfg):
        raise CheckpointError(f"{where}: checkpoint ansatz {state.get('ansatz')} != requested {asdict(wf.cfg)}")
    wf.load_state_dict(tensors["model"])
    load_optimizer_state(opt, tensors["optimizer"], state["optimizer"])
    restore_rng(state["rng"])
    if guard is not None:
        best = None
        if "best_model" in tensors and "best_optimizer" in state:
            best = GuardedState(tensors["best_model"],
                                optimizer_dict_from_tensors(tensors["best_optimizer"], state["best_optimizer"]))
        guard.load_state(state.get("guard"), best)
    restored = selected is not None and "selected" in tensors
    if restored:
        selected.load_state(tensors["selected"])
    if lbfgs is not None and "lbfgs" in state:
        load_lbfgs_state(lbfgs, tensors.get("lbfgs", {}), state["lbfgs"])
    return int(state["step"]), float(state["t0"]), restored


def existing_run(out: Path) -> Path | None:
    """The first file or folder that shows ``out`` already holds an NNQS run (None for a fresh folder)."""
    latest = checkpoint_store(out, None).latest()
    if latest is not None:
        return latest
    found = first_existing(out, (LEGACY_CHECKPOINT, *RUN_FILES))
    if found is not None and found.name == LOG and found.stat().st_size == 0:
        # opened before step 0 by a run that failed or was stopped there: no run, and it must not block the same
        # command (the log is appended to, so the new run writes into it as into a fresh one)
        return first_existing(out, (LEGACY_CHECKPOINT, *RUN_FILES[1:]))
    return found


def checkpointed_steps(out: Path) -> int | None:
    """The run length (``VMCConfig.steps``) the latest checkpoint in ``out`` was written under, if there is one: a
    resumed run keeps its schedule when ``--steps`` is left out, whatever today's default for its sector."""
    store = checkpoint_store(out, None)
    latest = store.latest()
    steps = store.read_state(latest).get("vmc", {}).get("steps") if latest is not None else None
    return int(steps) if steps is not None else None


def check_new_run(out: Path, resume: bool) -> None:
    """Refuse to mix two runs in one folder: a new run needs a fresh ``out`` (or ``--resume``, or ``--overwrite``)."""
    if not resume:
        refuse_run(out, existing_run(out))
        return
    store = checkpoint_store(out, None)
    latest = store.latest()
    if latest is not None:
        store.read_state(latest)  # a checkpoint of another kind (a training run) is refused before any work
    elif (out / LEGACY_CHECKPOINT).exists():
        raise ValueError(f"{out / LEGACY_CHECKPOINT}: a checkpoint of the older, non-atomic layout cannot be "
                         f"resumed; start a new run with another --out")


def _is_stray_temp(name: str) -> bool:
    """Temporary names of atomic writes (runtime.files; ``.<stem>.tmp-<pid>``: plots of earlier versions) of this
    run's own files."""
    if name.startswith(".write-test-"):
        return True
    return any(name.startswith((f".{f}.", f".{Path(f).stem}.tmp-")) for f in RUN_FILES) and ".tmp" in name


def clean_stale(out: Path) -> list[Path]:
    """Remove what killed runs left behind: temporary step directories and half-written files (main rank)."""
    removed = checkpoint_store(out, None).clean_stale()
    for folder, legacy in ((out, False), (out / LEGACY_CHECKPOINT, True)):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            legacy_temp = legacy and p.name.startswith((".model.", ".optimizer.", ".state.json."))
            if p.is_file() and (legacy_temp or (not legacy and _is_stray_temp(p.name))):
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed
