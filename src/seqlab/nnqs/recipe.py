"""The optimiser settings that go with each start: a warm start (the default) or a random start with annealing.

The starts, and a warm start past the sector fast path, need different optimisers, which is why these are not
single defaults in ``VMCConfig``:

- **Random start** (``--warm-start none``): entropy annealing keeps P broad while the phase MLP, at 10x the
  learning rate, learns the sign structure before P concentrates near Hartree-Fock (docs/nnqs.md, "Training
  recipe"). Adam's beta2 0.99 follows the fast-changing gradients of the annealing phase.
- **Warm start** (CCSD, CISD or HF fitted first): the signs and the largest amplitudes are already right, so there
  is no annealing. The phase MLP still learns at 10x: the connected triples are in neither CCSD nor CISD, and CISD
  has no quadruples either, whose signs VMC must find (N2 seed 0 from CISD, 2500 steps: 1.34 mHa with 10x; with 1x
  the run flattened at 2.06 mHa after 2975 steps, with 122 of the 650 configurations of c^2 > 1e-8 carrying the
  wrong sign). Adam moves every parameter by about the learning rate
  per step whatever its gradient, which a state fitted to 1e-4 infidelity cannot take at 5e-3 (measured on N2:
  lr 1e-2 collapsed onto HF within 10 steps even with exact gradients; 1e-3 and 2e-3 descended, 2e-3 faster). A
  long warmup (40 steps) and beta2 0.999 let Adam's second moments settle before the full rate is reached, and the
  cosine ends at 2 % of it, where the last mHa are gained without the oscillation of a constant rate.
- **Warm start past the sector fast path** (the selected sum, ``SELECTED_SUM``): a step costs seconds, so the
  fitted state cannot be thrown away and won back as on N2. Its steps are L-BFGS iterations on the summed energy
  (``lbfgs.py``), which descend from the fitted state at every evaluation, with the signs refitted to the space's
  own lowest state; for AdamW steps (``--lbfgs-steps 0``) the phase MLP at 1x and half the rate, with the step
  guard from step 0, descend where ``WARM_START`` set the state oscillating from the first step.

The number of steps grows with the sector (``default_steps``), because the cosine decay has to be stretched over
enough steps for the last mHa: LiH and H2O (225 and 441 determinants) end at 0.03-0.3 mHa after 400 steps, NH3
(3 136) ended at 1.39 and 1.59 mHa after 400 (too close to 1.6), and N2 (14 400) first crossed 1.6 mHa after about
1 450 steps. Hence 400 steps below 1 000 determinants, 1 000 below 10 000, and 2 500 from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqlab.nnqs.vmc import VMCConfig


@dataclass(frozen=True)
class Recipe:
    lr: float
    warmup: int
    anneal: float
    phase_lr_scale: float
    beta2: float
    min_lr_ratio: float
    rollback_tol_mha: float = VMCConfig.rollback_tol_mha  # the step guard (step_guard.py): tolerance and first
    rollback_after: int = VMCConfig.rollback_after  # step watched; VMCConfig's unless a recipe says otherwise
    lbfgs: bool = False  # every step takes L-BFGS iterations instead of an AdamW step (lbfgs.py)
    selected_sign_fit: int = VMCConfig.selected_sign_fit  # phase-fit steps per refit (sign_fit.py)
    checkpoint_every: int = VMCConfig.checkpoint_every  # steps between checkpoints


RANDOM_START = Recipe(lr=5e-3, warmup=20, anneal=0.07, phase_lr_scale=10.0, beta2=0.99, min_lr_ratio=0.05)
WARM_START = Recipe(lr=2e-3, warmup=40, anneal=0.0, phase_lr_scale=10.0, beta2=0.999, min_lr_ratio=0.02)
# past the sector fast path (the selected sum) a warm start keeps what it was fitted: the phase MLP at 1x and half
# the rate, with the guard watching from step 0 at 2 mHa. On H2O/6-31G from the same fitted state (7 108
# configurations) WARM_START's phase MLP at 10x set the energy oscillating from the first step (8 -> 62 mHa by step
# 40) and ended at 2.84 mHa after 1 500 steps; this recipe descended from the start and ended at 2.31 (docs/nnqs.md)
# Its steps are L-BFGS iterations on the selected sum (VMCConfig.lbfgs_iters each) with the phase network refitted
# to the space's own signs every selected_sign_fit_every steps: from the same fitted state, 51 such steps reached
# 2.16 mHa over S in 53 minutes in all, where AdamW's 1 500 steps took 72.5 minutes to 2.31 (docs/nnqs.md). The
# AdamW settings above still serve a run given --lbfgs-steps below --steps. A step there costs ~35 s, so a
# checkpoint every 5 steps: a run killed from outside (one was, for memory, at step 80 of 150) loses minutes, not all.
SELECTED_SUM = Recipe(lr=1e-3, warmup=40, anneal=0.0, phase_lr_scale=1.0, beta2=0.999, min_lr_ratio=0.02,
                      rollback_tol_mha=2.0, rollback_after=0, lbfgs=True, selected_sign_fit=3000, checkpoint_every=5)


# N_s per step where the sector is too large for the exact sum (VMCConfig.sector_max): each unique sample costs a
# local energy over its ~10^3 connected configurations, so N_s = 1e10 (every probable configuration; ~1e5 unique
# on H2O/6-31G after the warm start) needed 19 GB and was killed; 2 000 gives ~40-100 unique samples there, a few
# seconds a step on one core. It bounds the cost, not the outcome: that run still collapsed onto HF (docs/nnqs.md,
# "Past the sector fast path")
SAMPLED_SAMPLES = 2000
EXACT_SUM_SAMPLES = 10**10  # where every configuration is summed exactly N_s is unused; sampled on purpose, all
# N_s per step of the selected sum (the default past the sector fast path): its samples only name the configurations
# of the selected space, which are summed exactly, so N_s sets which probabilities are found (~1e-6 and up) and costs
# only the sampler's walk; on H2O/6-31G after the warm start it keeps ~6 000-7 000 configurations in the space
SELECTED_SAMPLES = 10**6

# (determinants in the (N_alpha, N_beta) sector up to which, VMC steps); larger sectors get LONG_RUN_STEPS
STEPS_BY_SECTOR = ((999, 400), (9_999, 1000))
LONG_RUN_STEPS = 2500
# the selected sum: 51 L-BFGS steps of 20 iterations, ~36 s each on H2O/6-31G (S ~ 8 000) on one thread, with the
# sign fit at steps 0 and 50 (the 51st step follows the last refit); with the fit below 53 minutes in all. AdamW's
# 1 500 steps (~2 s each) were the default before, 72.5 minutes in all on 2 cores
SELECTED_SUM_STEPS = 51
# the selected sum fits the warm-start state's 8 192 largest configurations (MAX_FIT_CONFIGS elsewhere): H2O/6-31G's
# CCSD+pt has 7 108 above |c|^2 = 1e-8, and fitted on all of them VMC starts at 8 mHa instead of 14 (a 24-minute fit)
SELECTED_SUM_FIT_CONFIGS = 8192


def default_steps(n_configurations: int, selected_sum: bool = False) -> int:
    """VMC steps when ``--steps`` is left out: 400 below 1 000 determinants, 1 000 below 10 000, 2 500 from there;
    ``SELECTED_SUM_STEPS`` where the steps take the selected sum."""
    if selected_sum:
        return SELECTED_SUM_STEPS
    return next((steps for limit, steps in STEPS_BY_SECTOR if n_configurations <= limit), LONG_RUN_STEPS)


def recipe_for(warm_start: str, selected_sum: bool = False) -> Recipe:
    """The recipe for a ``--warm-start`` method ("none" is the random start), and for a warm start whose steps take
    the selected sum."""
    if warm_start == "none":
        return RANDOM_START
    return SELECTED_SUM if selected_sum else WARM_START


def default_samples(n_configurations: int, sector_max: int, estimator: str = "auto") -> int:
    """N_s when ``--samples`` is left out: every probable configuration where the sector fast path holds the sector;
    past it ``SELECTED_SAMPLES`` for the selected sum (``auto``'s choice there), ``SAMPLED_SAMPLES`` when sampled."""
    if n_configurations <= sector_max:
        return EXACT_SUM_SAMPLES
    return SAMPLED_SAMPLES if estimator == "sampled" else SELECTED_SAMPLES
