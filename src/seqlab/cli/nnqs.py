"""``seqlab nnqs``: solve a molecule with the autoregressive Transformer wavefunction (VMC), next to PySCF's
HF / CCSD / CCSD(T) / FCI on the same orbitals. Writes DIR/result.json, DIR/energies.jsonl, DIR/convergence.png,
DIR/error.png and DIR/checkpoints/. The first SIGINT/SIGTERM finishes the step, checkpoints it and exits (resume
with --resume); a second SIGINT exits at once. Runs under ``torchrun --nproc-per-node N -m seqlab.cli.nnqs ...`` as well (gloo)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from seqlab.cli.nnqs_flags import ansatz_of, check_flags, check_resume_flags
from seqlab.nnqs.ansatz import AnsatzConfig
from seqlab.nnqs.driver import RunResult, run_vmc
from seqlab.nnqs.molecules import UNITS, get_molecule
from seqlab.nnqs.recipe import (EXACT_SUM_SAMPLES, RANDOM_START, SAMPLED_SAMPLES, SELECTED_SAMPLES, SELECTED_SUM,
                                 SELECTED_SUM_FIT_CONFIGS, SELECTED_SUM_STEPS, WARM_START, Recipe, default_samples,
                                 default_steps, recipe_for)
from seqlab.nnqs.references import build_pyscf, prepare
from seqlab.nnqs.sampler import SamplerConfig
from seqlab.nnqs.space import n_configurations
from seqlab.nnqs.vmc import HARTREE_TO_MHA, VMCConfig, check_exact_sum_fits, takes_selected_sum
from seqlab.nnqs.vmc_config import ESTIMATORS
from seqlab.nnqs.vmc_checkpoint import check_new_run, checkpointed_steps, existing_run
from seqlab.nnqs.warm_start import (MAX_FIT_CONFIGS, METHODS as WARM_START_METHODS, PHASE_WEIGHTS, WarmStartConfig,
                                    target_state)
from seqlab.runtime import atomic_write_text, progress as progress_bar
from seqlab.runtime.dist import barrier, init_distributed, set_cpu_threads, shutdown
from seqlab.runtime.files import ensure_writable_dir
from seqlab.runtime.memory import keep_freed_blocks
from seqlab.runtime.rundir import claim_run_dir
from seqlab.runtime.signals import GracefulStop

EPILOG = """\
Expected run time with the defaults (CCSD warm start with its Epstein-Nesbet step, a valence CASCI where CCSD
does not converge; exact sum; 1 thread, CPU time; see docs/nnqs.md):
  h2 ~10 s, lih ~45-65 s (0.05-0.15 mHa), h2o ~55-85 s (0.1-0.3 mHa), nh3 ~4 min (1000 steps,
  0.40-0.58 mHa, 3 seeds). n2 (20 spin orbitals, 14400 determinants): 2500 steps, ~20 min of CPU (10-11 min
  on 2 cores), 0.13-0.72 mHa (3 seeds, Intel Xeon). c2 (44100 determinants): 25-42 min on 2 cores, 0.40-1.11 mHa
  (3 seeds each on an Intel Xeon and an AMD EPYC).
  h2o --basis 6-31g (1.7 M determinants: the selected sum and its recipe): 2.35 mHa after 57 min on 2 cores
  (Intel Xeon; not yet chemical accuracy).
  --warm-start none: the earlier random-start recipe with entropy annealing.
Examples:
  seqlab nnqs --molecule h2o
  seqlab nnqs --molecule n2
  seqlab nnqs --atom "Li 0 0 0; H 0 0 1.6" --basis sto-3g --out runs/lih16
  seqlab nnqs --atom "O 0 0 0; H 0 0 0.97" --spin 1          # OH radical (ROHF orbitals)
  torchrun --standalone --nproc-per-node 2 -m seqlab.cli.nnqs --molecule lih   # samples split over 2 processes
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "nnqs", help="neural-network quantum state: VMC ground-state energy of a molecule",
        description="Train the autoregressive Transformer wavefunction psi(x) = sqrt(P(x)) exp(i phi(x)) over pair "
                    "tokens (one per spatial orbital) by variational Monte Carlo on the energy, then evaluate it and "
                    "compare with HF, CCSD, CCSD(T) and FCI from PySCF.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    mol = p.add_mutually_exclusive_group(required=True)
    mol.add_argument("--molecule", help="built-in molecule: h2, lih, h2o, nh3, n2, c2 (geometries of Choo et al.)")
    mol.add_argument("--atom", help='geometry, "El x y z; El x y z; ..." (in --unit, default Angstrom)')
    mol.add_argument("--xyz", metavar="FILE", help="geometry from a standard .xyz file (count, comment, El x y z)")
    p.add_argument("--unit", choices=UNITS, default=None,
                   help="unit of --atom / --xyz coordinates (default angstrom, the .xyz convention)")
    p.add_argument("--basis", default="sto-3g", help="PySCF basis set name (default sto-3g)")
    p.add_argument("--charge", type=int, default=None)
    p.add_argument("--spin", type=int, default=None, help="2S = N_alpha - N_beta (default 0)")
    p.add_argument("--steps", type=int, default=None,
                   help="VMC optimizer steps (default by the sector's size: 400 below 1000 determinants, 1000 below "
                        f"10000, 2500 from there; {SELECTED_SUM_STEPS} with the selected sum)")
    p.add_argument("--samples", type=float, default=None,
                   help=f"samples per step N_s (default {EXACT_SUM_SAMPLES:.0e} where the sector fast path holds the "
                        f"sector; past it {SELECTED_SAMPLES:.0e} for the selected sum, {SAMPLED_SAMPLES} with "
                        "--estimator sampled; cost grows with the *unique* samples only)")
    p.add_argument("--samples-final", type=float, default=None,
                   help="N_s at the last step: grows geometrically from --samples (default: constant N_s)")
    p.add_argument("--local-energy", choices=("exact", "sample-space"), default="exact",
                   help="exact (unbiased) or the sample-space approximation of NNQS-Transformer/NAQS (biased)")
    p.add_argument("--estimator", choices=ESTIMATORS, default="auto",
                   help="exact-sum: E and its gradient summed over the whole sector with exact probabilities (no "
                        "sampling noise; needs a sector of at most 200000 determinants); selected-sum: the same sum "
                        "over every configuration sampled so far (N_s a step; the energy of psi restricted to them); "
                        "sampled: N_s samples (--samples); auto (default): exact-sum where the sector allows it, "
                        "selected-sum past it")
    p.add_argument("--exact-tail", type=float, default=VMCConfig.exact_tail,
                   help="exact-sum: the gradient skips the least probable configurations holding this much "
                        f"probability (default {VMCConfig.exact_tail:g}; the energy always sums over all)")
    p.add_argument("--exact-max-configs", type=int, default=VMCConfig.exact_max_configs,
                   help="exact-sum: at most this many configurations in the gradient (default "
                        f"{VMCConfig.exact_max_configs})")
    p.add_argument("--selected-expand", type=int, default=VMCConfig.selected_expand, metavar="N",
                   help=f"selected-sum: every {VMCConfig.selected_expand_every} steps (from step 0) the N "
                        "configurations outside the space with the largest second-order energy join it for good, up "
                        f"to {VMCConfig.selected_expand_max} in all (default {VMCConfig.selected_expand}: none; on "
                        "H2O/6-31G 5000 took the space's own floor from 0.88 to 0.19 mHa, but psi gained only "
                        "0.05 mHa more in 300 steps at 2.5x the step cost; see docs/nnqs.md)")
    p.add_argument("--pin-warm-start", action="store_true",
                   help="selected-sum: the warm-start state's configurations stay in the space for good, however "
                        "improbable psi makes them (default: they leave like any other; see docs/nnqs.md)")
    p.add_argument("--selected-sign-fit", type=int, default=None, metavar="N",
                   help=f"selected-sum: every {VMCConfig.selected_sign_fit_every} steps (from step 0) the phase "
                        "network takes N Adam steps towards the signs of H's lowest state on the space (default "
                        f"{SELECTED_SUM.selected_sign_fit} with the selected sum's warm start, else "
                        f"{VMCConfig.selected_sign_fit}: never; see docs/nnqs.md)")
    p.add_argument("--lbfgs-steps", type=int, default=None, metavar="N",
                   help="exact and selected sum: the last N of the steps take L-BFGS iterations on the summed energy "
                        "instead of AdamW steps (default: all of them with the selected sum's warm start, else none; "
                        "see docs/nnqs.md)")
    p.add_argument("--lbfgs-iters", type=int, default=VMCConfig.lbfgs_iters, metavar="K",
                   help=f"L-BFGS iterations per step, each one or a few evaluations (default {VMCConfig.lbfgs_iters})")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak AdamW learning rate, then cosine decay (default {WARM_START.lr:g} after a warm start, "
                        f"{SELECTED_SUM.lr:g} after one with the selected sum, {RANDOM_START.lr:g} from a random "
                        "start; see seqlab.nnqs.recipe)")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"linear warmup steps, >= 0 (default {WARM_START.warmup} / {RANDOM_START.warmup})")
    p.add_argument("--min-lr-ratio", type=float, default=None,
                   help=f"the cosine ends at lr x this, in (0, 1] (default {WARM_START.min_lr_ratio:g} / "
                        f"{RANDOM_START.min_lr_ratio:g})")
    p.add_argument("--phase-lr-scale", type=float, default=None,
                   help=f"learning rate of the phase MLP relative to --lr, > 0 (default {WARM_START.phase_lr_scale:g} "
                        f"/ {RANDOM_START.phase_lr_scale:g}; {SELECTED_SUM.phase_lr_scale:g} with the selected sum)")
    p.add_argument("--beta2", type=float, default=None,
                   help=f"Adam's second-moment decay, in (0, 1) (default {WARM_START.beta2:g} / "
                        f"{RANDOM_START.beta2:g})")
    p.add_argument("--warm-start", choices=WARM_START_METHODS, default="ccsd",
                   help="fit this PySCF state before VMC (default ccsd: exp(T)|HF> from PySCF's CCSD amplitudes; "
                        "where CCSD does not converge, as in stretched bonds, the lower in energy of cisd and "
                        "casci, the exact state of 6 electrons in the 6 orbitals around the Fermi level); none = "
                        "random start with entropy annealing, the earlier recipe, which open shells (no restricted "
                        "CCSD or CISD) also get")
    p.add_argument("--warm-start-pt", action=argparse.BooleanOptionalAction, default=True,
                   help="add one Epstein-Nesbet perturbative step to the warm-start state (first-order connected "
                        "triples and beyond; one H application over the sector), kept only if it lowers the state's "
                        "energy (default on; --no-warm-start-pt fits the state as the method gives it)")
    p.add_argument("--warm-start-max-configs", type=int, default=None, metavar="N",
                   help=f"fit at most the N largest configurations of the warm-start state (default "
                        f"{MAX_FIT_CONFIGS}, {SELECTED_SUM_FIT_CONFIGS} where the steps take the selected sum: "
                        "H2O/6-31G's CCSD+pt state has 7108 above |c|^2 = 1e-8, and fitted on all of them VMC starts "
                        "at 8 instead of 14 mHa, for a 4x longer fit; see docs/nnqs.md)")
    p.add_argument("--warm-start-steps", type=int, default=WarmStartConfig.steps,
                   help=f"supervised steps of the warm start (default {WarmStartConfig.steps})")
    p.add_argument("--warm-start-phase-weight", choices=PHASE_WEIGHTS, default=WarmStartConfig.phase_weight,
                   help="what weighs each configuration's sign in the warm start's phase loss: |c| (amplitude) or "
                        f"|c|^2 (probability, as before 2026-12-03) (default {WarmStartConfig.phase_weight})")
    p.add_argument("--anneal", type=float, default=None,
                   help="entropy annealing strength (fraction of the diagonal energy spread, >= 0); 0 disables "
                        f"(default {WARM_START.anneal:g} after a warm start, {RANDOM_START.anneal:g} with --warm-start "
                        "none)")
    p.add_argument("--rollback-tol", type=float, default=None, metavar="MHA",
                   help="exact- and selected-sum runs: from step --rollback-after on, a step whose energy lies "
                        "this many mHa above the best seen restores the best state and halves the learning rate; "
                        f"0 disables (default {WARM_START.rollback_tol_mha:g}, {SELECTED_SUM.rollback_tol_mha:g} "
                        "with the selected sum)")
    p.add_argument("--rollback-after", type=int, default=None, metavar="STEP",
                   help=f"first step the rollback rule watches (default {WARM_START.rollback_after}, "
                        f"{SELECTED_SUM.rollback_after} with the selected sum)")
    p.add_argument("--sr", action="store_true", help="stochastic reconfiguration (minSR; slow, small systems)")
    p.add_argument("--d-model", type=int, default=AnsatzConfig.d_model,
                   help="decoder width (amplitudes; default %(default)s)")
    p.add_argument("--layers", type=int, default=AnsatzConfig.n_layers, help="decoder layers (default %(default)s)")
    p.add_argument("--heads", type=int, default=AnsatzConfig.n_heads, help="attention heads (default %(default)s)")
    p.add_argument("--phase-hidden", type=int, default=AnsatzConfig.phase_hidden,
                   help="width of the phase MLP's hidden layers (default %(default)s)")
    p.add_argument("--phase-layers", type=int, default=AnsatzConfig.phase_layers,
                   help="hidden layers of the phase MLP (default %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="sample without the KV cache (recompute prefixes)")
    p.add_argument("--max-batch", type=int, default=65536,
                   help="unique prefixes per sampling chunk (>= 1; default 65536)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default runs/nnqs-<molecule>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT if there is one")
    p.add_argument("--overwrite", action="store_true",
                   help="OUT holds a run: move it aside to OUT.old-<time> and start a new one")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between checkpoints (>= 1; default 100, 5 where the steps take the selected sum)")
    p.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also write the per-step metrics as TensorBoard event files into DIR")
    p.add_argument("--no-cc", action="store_true", help="skip CCSD/CCSD(T) references")
    p.add_argument("--no-fci", action="store_true", help="skip the FCI reference")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _fmt(e: float | None) -> str:
    return "—" if e is None else f"{e:.6f}"


def final_table(result: dict) -> str:
    fci = result["e_fci"]
    rows = [("HF", result["e_hf"]), ("CCSD", result["e_ccsd"]), ("CCSD(T)", result["e_ccsd_t"]), ("FCI", fci)]
    lines = [f"{result['molecule']} ({result['basis']}, {result['n_electrons']} electrons, "
             f"{result['n_spin_orbitals']} spin orbitals, {result['n_configurations']} determinants)",
             f"{'method':<10}{'energy (Ha)':>22}{'- FCI (mHa)':>14}"]
    for name, e in rows:
        d = "" if e is None or fci is None else f"{(e - fci) * HARTREE_TO_MHA:14.3f}"
        lines.append(f"{name:<10}{_fmt(e):>22}{d}")
    e, sd = result["energy"], result["energy_std"]
    nn = f"{e:.6f} ± {sd:.6f}" if sd else f"{e:.6f} (exact)"
    d = "" if fci is None else f"{result['error_mha']:14.3f}"
    lines.append(f"{'NNQS':<10}{nn:>22}{d}")
    lines.append(f"wall time {result['wall_time_s']:.1f} s, {result['steps']} steps, N_s = {result['samples']:.3g}, "
                 f"local energy: {result['local_energy']}, final evaluation: {result['final_eval']}")
    if fci is not None:
        ok = abs(result["error_mha"]) < 1.6
        lines.append("chemical accuracy (|NNQS - FCI| < 1.6 mHa): " + ("yes" if ok else "NO"))
    return "\n".join(lines)


def fill_recipe(args: argparse.Namespace, recipe: Recipe) -> None:
    """Optimiser flags left out take the values that go with the start actually made (``nnqs.recipe``)."""
    for name in ("lr", "warmup", "anneal", "min_lr_ratio", "phase_lr_scale", "beta2", "rollback_tol",
                 "rollback_after", "selected_sign_fit", "checkpoint_every"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(recipe, "rollback_tol_mha" if name == "rollback_tol" else name))


def result_record(args: argparse.Namespace, mol, ham, refs, res, samples: int, ansatz: AnsatzConfig,
                  world_size: int, wall_s: float, t_ref: float, cpu_s: float) -> dict:
    """result.json: the run's inputs, the NNQS energy and every reference on the same orbitals; the time fields
    cover the whole run (a resumed one's checkpoint carries its time so far)."""
    fin = res.final

    def error_mha(e: float | None) -> float | None:
        return None if e is None or refs.e_fci is None else (e - refs.e_fci) * HARTREE_TO_MHA

    return {
        "molecule": mol.name, "atom": mol.atom_string(), "unit": mol.unit, "basis": mol.basis,
        "charge": mol.charge, "spin": mol.spin, "n_spin_orbitals": ham.n_so, "n_electrons": mol.n_electrons,
        "n_alpha": mol.n_alpha, "n_beta": mol.n_beta, "n_configurations": fin["n_configurations"],
        "energy": fin["energy"], "energy_std": fin["energy_std"], "energy_variance": fin["variance"],
        "final_eval": fin["final_eval"], "final_eval_samples": fin["final_eval_samples"],
        "final_eval_time_s": fin["time_s"],
        "selected_energy": fin.get("selected_energy"), "selected_size": fin.get("selected_size"),
        "selected_error_mha": error_mha(fin.get("selected_energy")),
        "selected_ci_energy": fin.get("selected_ci_energy"),
        "selected_ci_error_mha": error_mha(fin.get("selected_ci_energy")),
        "e_hf": refs.e_hf, "e_ccsd": refs.e_ccsd, "e_ccsd_t": refs.e_ccsd_t, "e_fci": refs.e_fci,
        "e_fci_sector": refs.e_fci_sector,
        "error_mha": error_mha(fin["energy"]), "e_ccsd_t_error_mha": error_mha(refs.e_ccsd_t),
        "steps": args.steps, "samples": samples, "local_energy": args.local_energy,
        "estimator": res.estimator, "seed": args.seed,
        "world_size": world_size, "n_parameters": sum(p.numel() for p in res.wavefunction.parameters()),
        "ansatz": ansatz.__dict__, "lr": args.lr, "warmup": args.warmup,
        "min_lr_ratio": args.min_lr_ratio, "phase_lr_scale": args.phase_lr_scale, "beta2": args.beta2,
        "anneal": args.anneal, "sr": args.sr, "rollback_tol_mha": args.rollback_tol,
        "rollback_after": args.rollback_after, "rollbacks": res.rollbacks, "selected_expand": args.selected_expand,
        "pin_warm_start": args.pin_warm_start,
        "selected_sign_fit": args.selected_sign_fit, "lbfgs_steps": args.lbfgs_steps, "lbfgs_iters": args.lbfgs_iters,
        "checkpoint_every": args.checkpoint_every, "warm_start": res.warm_start, "kv_cache": not args.no_cache,
        "wall_time_s": res.elapsed_before["wall_s"] + wall_s, "cpu_time_s": res.elapsed_before["cpu_s"] + cpu_s,
        "vmc_time_s": res.elapsed_before["vmc_s"] + res.wall_time_s,
        "reference_time_s": t_ref, "notes": refs.notes,
    }


def run(args: argparse.Namespace) -> int:
    samples = check_flags(args)
    mol = get_molecule(args.molecule, args.atom, args.basis, args.charge, args.spin, xyz=args.xyz, unit=args.unit)
    pmol = build_pyscf(mol)  # the basis, no SCF yet: the orbital count, so the sector's size, is known here
    n_conf = n_configurations(pmol.nao, mol.n_alpha, mol.n_beta)
    check_exact_sum_fits(args.estimator, n_conf, "--estimator")
    out = Path(args.out or os.path.join("runs", f"nnqs-{mol.name.lower()}"))
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other: continue the run in --out, or replace it")
    ensure_writable_dir(out, "--out")
    if args.tensorboard:
        ensure_writable_dir(args.tensorboard, "--tensorboard")
    if not args.overwrite:  # (with --overwrite the main rank moves an old run aside below)
        check_new_run(out, args.resume)
    if args.resume:  # the flags against the checkpoint now, not after minutes of references
        check_resume_flags(args, out, pmol.nao, mol.n_alpha, mol.n_beta, n_conf)
    dist = init_distributed(backend="gloo", device="cpu")  # seqlab.nnqs runs on CPU
    set_cpu_threads(args.threads, dist)
    # a step makes and frees the same large tensors (psi, H psi and the activations over S) every time; glibc's
    # defaults gave them fresh pages each step: 1.85 M page faults and 4.2 s a step on H2O/6-31G over 21 370
    # configurations, 2.8 s with the pages kept (docs/nnqs.md)
    keep_freed_blocks()
    try:
        moved = claim_run_dir(out, existing_run(out), overwrite=True) if args.overwrite and dist.is_main else None
        if moved is not None:
            print(f"[seqlab] --overwrite: the previous run in {out} was moved to {moved}", file=sys.stderr)
        barrier(dist)  # no rank looks at --out before an old run has left it
        t0, cpu0 = time.perf_counter(), time.process_time()
        system = prepare(mol, fci=not args.no_fci, cc=not args.no_cc, pmol=pmol)
        t_ref = time.perf_counter() - t0
        refs, ham = system.references, system.hamiltonian
        selected_sum = takes_selected_sum(args.estimator, args.local_energy, n_conf, VMCConfig.sector_max)
        if args.warm_start_max_configs is None:
            args.warm_start_max_configs = SELECTED_SUM_FIT_CONFIGS if selected_sum else MAX_FIT_CONFIGS
        warm = target_state(args.warm_start, system.mf, ham.n_orb, ham.n_alpha, ham.n_beta, perturb=args.warm_start_pt,
                            max_configs=args.warm_start_max_configs)
        recipe = recipe_for("none" if warm is None else warm.method, selected_sum)
        fill_recipe(args, recipe)
        samples = samples or default_samples(n_conf, VMCConfig.sector_max, args.estimator)
        if args.steps is None:  # a resumed run keeps the length it was started with
            args.steps = ((checkpointed_steps(out) if args.resume else None)
                          or default_steps(n_conf, selected_sum))
        if args.lbfgs_steps is None:
            args.lbfgs_steps = args.steps if recipe.lbfgs else 0
        cfg = VMCConfig(steps=args.steps, samples=samples, lr=args.lr,
                        samples_final=None if args.samples_final is None else int(args.samples_final),
                        warmup=args.warmup, anneal=args.anneal, min_lr_ratio=args.min_lr_ratio,
                        phase_lr_scale=args.phase_lr_scale, betas=(VMCConfig.betas[0], args.beta2),
                        local_energy=args.local_energy, estimator=args.estimator, exact_tail=args.exact_tail,
                        exact_max_configs=args.exact_max_configs, sr=args.sr, seed=args.seed,
                        checkpoint_every=args.checkpoint_every, rollback_tol_mha=args.rollback_tol,
                        rollback_after=args.rollback_after, selected_expand=args.selected_expand,
                        selected_pin_warm_start=args.pin_warm_start,
                        selected_sign_fit=args.selected_sign_fit, lbfgs_steps=args.lbfgs_steps,
                        lbfgs_iters=args.lbfgs_iters,
                        sampler=SamplerConfig(use_cache=not args.no_cache, max_batch=args.max_batch))
        ansatz = ansatz_of(args)
        bar = progress_bar(total=args.steps, desc=f"nnqs {mol.name}", unit="step",
                           enabled=dist.is_main and not args.quiet)
        for note in refs.notes if dist.is_main and not args.quiet else ():
            bar.write(f"note: {note}")

        def show(st) -> None:
            if not bar.n:  # the rate from VMC's first step, not from before the references and the warm-start fit
                bar.reset(total=args.steps)
                bar.n = bar.initial = st.step  # a resumed run counts on from its checkpoint
            post = {"E": f"{st.energy:.6f}", "σ": f"{st.energy_std * HARTREE_TO_MHA:.3f}mHa", "U": st.n_unique}
            if refs.e_fci is not None:
                post["ΔFCI"] = f"{(st.energy - refs.e_fci) * HARTREE_TO_MHA:.2f}mHa"
            bar.set_postfix(post, refresh=False)
            bar.update(1)

        levels = {"HF": refs.e_hf, "CCSD(T)": refs.e_ccsd_t, "FCI": refs.e_fci}
        fit_cfg = WarmStartConfig(steps=args.warm_start_steps, phase_weight=args.warm_start_phase_weight)
        with bar, GracefulStop() as stop:
            res = run_vmc(ham, cfg, ansatz, out, dist, e_ref=refs.e_fci, resume=args.resume,
                          callback=None if args.quiet else show,
                          title=f"{mol.name} / {mol.basis}", references=levels, tensorboard=args.tensorboard,
                          stop=stop, warm_start=warm, warm_start_cfg=fit_cfg, started=(t0, cpu0))
        if res.stopped_at is not None:
            return stopped(res, out, stop, dist.is_main)
        if not dist.is_main:
            return 0
        result = result_record(args, mol, ham, refs, res, samples, ansatz, dist.world_size,
                               time.perf_counter() - t0, t_ref, time.process_time() - cpu0)
        atomic_write_text(out / "result.json", json.dumps(result, indent=2) + "\n")
        print(final_table(result))
        print(f"wrote {out / 'result.json'}, {out / 'energies.jsonl'}, {out / 'convergence.png'}"
              + (f", {out / 'error.png'}" if refs.e_fci is not None else ""))
        return 0
    finally:
        shutdown(dist)


def stopped(res: RunResult, out: Path, stop: GracefulStop, is_main: bool) -> int:
    """After a signal: say where the checkpoint is and how to continue; exit 128 + the signal's number."""
    if is_main and res.checkpoint is None:
        print("stopped during the warm start: nothing was checkpointed; the same command starts afresh",
              file=sys.stderr)
    elif is_main:
        print(f"stopped after step {res.stopped_at}: checkpoint {res.checkpoint}; continue with the same command "
              f"and --resume", file=sys.stderr)
    return stop.exit_code


if __name__ == "__main__":  # python -m seqlab.cli.nnqs ... is `seqlab nnqs ...`, one-line errors included
    from seqlab.cli import main

    sys.exit(main(["nnqs", *sys.argv[1:]]))
