"""The VMC driver: build the wavefunction and optimizer, run the steps, log, checkpoint, resume, evaluate.

It stands on the runtime floor like the Trainer does (the logbook, the checkpoint store, the process group and the
graceful stop); what is VMC's own is only the step (``vmc.py``) and the final evaluation (``evaluate.py``).
Writes on rank 0, when ``out`` is given: energies.jsonl (one row per step), checkpoints/ every
``checkpoint_every`` steps, at the end and on a stop request, convergence.png and (with a reference) error.png.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.evaluate import evaluate_energy
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.lbfgs import build_lbfgs, lbfgs_step, reset_history
from seqlab.nnqs.resume import check_same_run, elapsed_before, elapsed_now, start_settings, vmc_settings
from seqlab.nnqs.step_guard import StepGuard
from seqlab.nnqs.vmc import HARTREE_TO_MHA, StepStats, VMCConfig, build_sector, build_selected, initial_temperature, \
    uses_exact_sum, vmc_step
from seqlab.nnqs.warm_start import TargetState, WarmStartConfig, fit
from seqlab.nnqs.vmc_checkpoint import LOG, check_new_run, checkpoint_store, clean_stale, load_checkpoint, \
    save_checkpoint
from seqlab.runtime.dist import DistInfo, any_rank, barrier
from seqlab.runtime.logbook import Logbook
from seqlab.runtime.memory import TrimOnGrowth, status_kib
from seqlab.runtime.signals import GracefulStop

CHEMICAL_ACCURACY_MHA = 1.6
STOP_POLL = 20  # warm-start fit steps between stop checks across ranks (each check is an all-reduce)


@dataclass
class RunResult:
    wavefunction: Wavefunction
    records: list[dict]
    final: dict | None  # None when a stop request ended the run early (no final evaluation)
    wall_time_s: float
    stopped_at: int | None = None  # completed steps when a signal stopped the run
    checkpoint: Path | None = None  # the last checkpoint written or loaded
    warm_start: dict | None = None  # the supervised fit's losses and overlap (a resumed run: its checkpoint's)
    estimator: str = "sampled"  # what the steps used: "exact-sum", "selected-sum" or "sampled" (resolved "auto")
    rollbacks: list[int] = field(default_factory=list)  # steps whose energy jump the step guard undid (exact-sum runs)
    # the time the run had taken up to the checkpoint it resumed from (resume.CLOCKS; zeros for a fresh run)
    elapsed_before: dict[str, float] = field(default_factory=lambda: elapsed_before(None))


def build_optimizer(wf: Wavefunction, cfg: VMCConfig) -> torch.optim.Optimizer:
    groups = [{"params": list(wf.decoder.parameters()), "lr_scale": 1.0},
              {"params": list(wf.phase_net.parameters()), "lr_scale": cfg.phase_lr_scale}]
    if cfg.sr:  # the natural-gradient direction is already preconditioned: plain steps along it
        return torch.optim.SGD(groups, lr=cfg.lr)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def run_vmc(ham: Hamiltonian, cfg: VMCConfig, ansatz: AnsatzConfig | None = None, out: str | Path | None = None,
            dist: DistInfo | None = None, e_ref: float | None = None, resume: bool = False,
            callback: Callable[[StepStats], None] | None = None, title: str = "NNQS", *,
            references: dict[str, float | None] | None = None, tensorboard: str | Path | None = None,
            stop: GracefulStop | None = None, warm_start: TargetState | None = None,
            warm_start_cfg: WarmStartConfig | None = None,
            started: tuple[float, float] | None = None) -> RunResult:
    """Train a fresh (or resumed) wavefunction for ``cfg.steps`` steps, then evaluate its energy.

    ``e_ref`` (FCI) adds ``error_mha`` to every row; ``references`` ({"HF": e, "CCSD(T)": e, ...}) are drawn as
    levels in the plots. A fresh run with ``warm_start`` first fits that state (``warm_start.fit``; a resumed run
    has its parameters already). When ``stop.requested`` turns true (a signal), the run finishes its step,
    checkpoints it and returns with ``stopped_at`` set and no final evaluation; during the warm-start fit it returns
    at once with ``stopped_at`` 0 and no checkpoint. ``callback(stats)`` follows every step.

    A resume refuses settings (``cfg``, the warm start) other than the checkpoint's (``resume.check_same_run``) and
    carries the warm-start record and the time so far over; ``started`` (``time.perf_counter()``,
    ``time.process_time()``) is when this invocation's work began (default: now), for the time checkpoints record.
    """
    started = started or (time.perf_counter(), time.process_time())
    dist = dist or DistInfo()
    if cfg.sr and dist.world_size > 1:
        raise ValueError("VMCConfig.sr: stochastic reconfiguration is implemented for one process only")
    out = Path(out) if out is not None else None
    torch.manual_seed(cfg.seed)  # identical initial parameters on every rank
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, ansatz)
    opt = build_optimizer(wf, cfg)
    store = checkpoint_store(out, cfg.keep_last) if out is not None else None
    guard = StepGuard(cfg.rollback_tol_mha, cfg.rollback_after)  # switched off below for sampled runs
    start_step, t0, checkpoint, restored, saved = 0, None, None, False, None
    if store is not None:
        check_new_run(out, resume)
        barrier(dist)  # every rank has looked at ``out`` before the main rank writes into it
        if dist.is_main:
            clean_stale(out)
        checkpoint = store.latest() if resume else None
    t_start = time.perf_counter()
    sector = build_sector(ham, cfg, dist)
    exact = uses_exact_sum(cfg, sector)
    selected = None if exact else build_selected(ham, cfg)  # before the checkpoint, which may restore it
    if cfg.lbfgs_steps and not exact and selected is None:  # before the warm-start fit, which may take minutes
        raise ValueError("VMCConfig.lbfgs_steps: L-BFGS needs a summed energy (the exact or selected sum), not samples")
    lbfgs = build_lbfgs(wf, cfg) if cfg.lbfgs_steps else None  # before the checkpoint, which restores its history
    vmc_state, start_state = vmc_settings(cfg), start_settings(warm_start, warm_start_cfg)
    # annealing ends where the run first planned it: re-stretched over a resume's extra steps, it heated a finished
    # run (T = 0) again (an OH run resumed from 400 to 1000 steps jumped from 1.9 to 814 mHa and ended at 4.0)
    anneal_end = cfg.anneal_frac * cfg.steps
    if checkpoint is not None:
        saved = store.read_state(checkpoint)
        # the orbitals first: another geometry also changes settings that follow from it (the warm start's size),
        # and a refusal naming those would blame a flag the user never gave
        start_step, t0, restored = load_checkpoint(store, checkpoint, wf, opt, guard, ham, selected, lbfgs)
        check_same_run(checkpoint / "state.json", saved, vmc_state, start_state, asdict(wf.cfg))
        anneal_end = float(saved.get("anneal_end", saved["vmc"]["anneal_frac"] * saved["vmc"]["steps"]))
        if start_step > cfg.steps:  # fewer steps than it ran: say so rather than rewrite its result with fewer
            raise ValueError(f"VMCConfig.steps={cfg.steps}: the run already holds {start_step} steps; resume with "
                             f"more --steps to continue it")
    warm = (saved or {}).get("warm_fit")  # a resumed run's fit happened before its checkpoint
    before = elapsed_before(saved)
    if warm_start is not None and checkpoint is None:  # same seed, same data: every rank fits the same parameters
        t_fit = time.perf_counter()

        def fit_stop(step: int) -> bool:  # all ranks agree, every STOP_POLL steps when there are several
            if stop is None or (dist.world_size > 1 and step % STOP_POLL):
                return False
            return any_rank(stop.requested, dist)

        warm = fit(wf, warm_start, warm_start_cfg or WarmStartConfig(), progress=dist.is_main and callback is not None,
                   should_stop=fit_stop)
        if warm is None:  # stopped during the fit: no checkpoint, so the same command starts afresh
            return RunResult(wf, [], None, time.perf_counter() - t_start, 0, None, None, elapsed_before=before)
        warm["time_s"] = time.perf_counter() - t_fit
        t_start += warm["time_s"]  # VMC's clock (vmc_time_s, each step's wall_time_s): the fit is timed apart
    if t0 is None:
        t0 = initial_temperature(wf, ham, cfg, dist)
    step_cfg = replace(cfg, anneal_frac=anneal_end / cfg.steps)  # the steps' own view of it
    if selected is not None and warm_start is not None and not restored:  # S holds the fitted support from step 0
        (selected.pin if cfg.selected_pin_warm_start else selected.add)(warm_start.keys)
    estimator = "exact-sum" if exact else "selected-sum" if selected is not None else "sampled"
    guard.active = estimator != "sampled" and cfg.anneal == 0  # only an exact, unannealed energy can be judged
    log = Logbook(out / LOG if out is not None else Path(LOG), resume_step=start_step - 1 if start_step else None,
                  tensorboard_dir=tensorboard, enabled=out is not None and dist.is_main)
    records = log.rows() if log.enabled else []
    stopped_at = None
    with log:
        heap = TrimOnGrowth()
        heap.trim()  # what the references and a warm-start fit freed
        for step in range(start_step, cfg.steps):
            guard.before_step(step, wf, opt)
            if lbfgs is not None and step >= cfg.steps - cfg.lbfgs_steps:
                st = lbfgs_step(wf, lbfgs, cfg, step, dist, sector if exact else None, selected)
            else:
                st = vmc_step(wf, ham, opt, step_cfg, step, dist, t0, sector, selected)
            rec = asdict(st)
            if guard.after_step(step, st.energy, wf, opt):
                rec["rolled_back_to"] = guard.best_step
                if lbfgs is not None:
                    reset_history(lbfgs)
            rec["wall_time_s"] = before["vmc_s"] + time.perf_counter() - t_start  # over the whole run
            rss = status_kib("VmRSS")  # a run that grows towards the machine's memory shows it step by step
            rec["resident_gib"] = None if rss is None else rss / 2**20
            rec["heap_trimmed"] = heap.after_step(rss)
            if e_ref is not None:
                rec["error_mha"] = (st.energy - e_ref) * HARTREE_TO_MHA
                rec["abs_error_mha"] = abs(rec["error_mha"])
            records.append(rec)
            log.append(rec)
            if callback is not None:
                callback(st)
            done = step + 1
            stopping = stop is not None and any_rank(stop.requested, dist)  # every rank leaves at the same step
            if store is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps or stopping):
                if dist.is_main:
                    run = {"start": start_state, "warm_fit": warm, "elapsed": elapsed_now(before, started, t_start),
                           "anneal_end": anneal_end}
                    checkpoint = save_checkpoint(store, wf, opt, done, t0, vmc_state, guard, ham,
                                                 selected, lbfgs, run)
            if stopping:
                stopped_at = done
                break
    if out is not None and dist.is_main and records:
        plot_convergence(log, out, references or {}, e_ref, title)
    if stopped_at is not None:
        return RunResult(wf, records, None, time.perf_counter() - t_start, stopped_at, checkpoint, warm, estimator,
                         guard.rollbacks, before)
    t_eval = time.perf_counter()
    final = evaluate_energy(wf, ham, cfg, dist, selected=selected)
    final["time_s"] = time.perf_counter() - t_eval
    return RunResult(wf, records, final, time.perf_counter() - t_start, None, checkpoint, warm, estimator,
                     guard.rollbacks, before)


def plot_convergence(log: Logbook, out: Path, references: dict[str, float | None], e_ref: float | None,
                     title: str) -> None:
    """convergence.png: every step's energy (no clipped start) with the reference levels; error.png: |E - FCI|.

    The energy axis must hold the first steps (Hartree or more above FCI) and the references (mHa apart) at
    once, so the error plot's log axis is where the end of a run can be read.
    """
    levels = {name: e for name, e in references.items() if e is not None}
    if e_ref is not None:
        levels.setdefault("FCI", e_ref)
    # each reference has its own colour and dash; the labels carry the values, which may lie mHa apart
    log.plot(out / "convergence.png", "step", ["energy"], "energy (Ha)", title,
             hlines={f"{name} {e:.6f}": e for name, e in levels.items()})
    if e_ref is not None:
        errors = {name: abs(e - e_ref) * HARTREE_TO_MHA for name, e in levels.items()}
        errors = {f"{name} error {v:.3g} mHa": v for name, v in errors.items() if v > 1e-6}
        errors[f"chemical accuracy {CHEMICAL_ACCURACY_MHA} mHa"] = CHEMICAL_ACCURACY_MHA
        log.plot(out / "error.png", "step", ["abs_error_mha"], "|E - E_FCI| (mHa)", title, hlines=errors, logy=True)
