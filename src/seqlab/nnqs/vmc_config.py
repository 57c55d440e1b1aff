"""The settings of a VMC run (``vmc.py`` takes its steps, ``driver.py`` runs them): one dataclass, validated on
construction, so a bad value names its field before any molecule is built. The recipes that go with each start are
in ``recipe.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from seqlab.nnqs.local_energy import MODES
from seqlab.nnqs.sampler import SamplerConfig

ESTIMATORS = ("auto", "exact-sum", "selected-sum", "sampled")


@dataclass
class VMCConfig:
    steps: int = 400
    samples: int = 10**10  # N_s per step, over all ranks (only unique configurations cost compute)
    # N_s grows geometrically from ``samples`` to this at the last step: the rare configurations whose amplitudes
    # decide the last mHa are seen late, when they matter, at the price of more unique samples only then
    samples_final: int | None = None
    lr: float = 5e-3
    warmup: int = 20
    min_lr_ratio: float = 0.05  # cosine decay to lr * min_lr_ratio at the last step
    weight_decay: float = 0.0
    phase_lr_scale: float = 10.0  # the phase MLP may learn faster than the amplitudes (see docs/nnqs.md)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = 1.0
    local_energy: str = "exact"
    # exact E_loc through H precomputed over the whole (N_alpha, N_beta) sector (local_energy.SectorHamiltonian)
    # when the sector has at most this many configurations; 0 disables. Costs per step one no-grad pass over the
    # whole sector (prefix tree on the KV cache), and memory of about 12 bytes x N_conf x (singles + doubles).
    sector_max: int = 200_000
    # how E and its gradient are estimated: "exact-sum" sums over the whole sector with exact probabilities (needs
    # the sector fast path; no sampling noise, no collapse onto HF), "selected-sum" sums exactly over every
    # configuration sampled so far (N_s samples a step join the space), "sampled" draws N_s samples, "auto" takes
    # exact-sum whenever the sector fast path applies and selected-sum past it
    estimator: str = "auto"
    # exact-sum: the gradient is summed over the most probable configurations holding all but this mass ...
    exact_tail: float = 1e-8
    exact_max_configs: int = 16384  # ... and at most this many (bounds the backward's cost)
    # selected-sum: a configuration leaves the selected space when its probability (over the space) falls below this
    selected_min_prob: float = 1e-9
    # selected-sum: at most this many sampled configurations join the space in one step, the most often drawn first.
    # A step that moved psi's weight off the space would otherwise bring in up to N_s of them with H among them:
    # the one H2O/6-31G run that was killed for memory (24 GB, docs/nnqs.md) held ~11 000 configurations a step
    # before; the cap leaves the rest to later steps, where ``StepStats.n_join_skipped`` and ``outside_mass`` show it
    selected_join_max: int = 20_000
    # selected-sum: every ``selected_expand_every`` steps the ``selected_expand`` configurations outside the space with
    # the largest second-order energy join it for good (``SelectedSpace.expand``), up to ``selected_expand_max`` in
    # all; 0 adds none
    selected_expand: int = 0
    # selected-sum: the warm-start state's configurations are pinned in the space (never pruned) instead of merely
    # joining it: the fit weighs them by |c|^2, so the smallest fall below ``selected_min_prob`` and leave, which
    # raised S's own floor on H2O/6-31G from 0.26 to 0.77 mHa (docs/nnqs.md, "Pinning the warm-start support")
    selected_pin_warm_start: bool = False
    selected_expand_every: int = 100
    selected_expand_max: int = 20_000
    # selected-sum: every ``selected_sign_fit_every`` steps (from step 0) the phase network takes this many Adam steps
    # towards the signs of H's ground state on the space (``sign_fit.py``); 0: never
    selected_sign_fit: int = 0
    selected_sign_fit_every: int = 50
    # exact and selected sum: the last ``lbfgs_steps`` of the ``steps`` take ``lbfgs_iters`` L-BFGS iterations each
    # (strong-Wolfe line search, ``lbfgs_history`` curvature pairs) on the summed energy instead of an AdamW step
    # (lbfgs.py); 0: AdamW throughout
    lbfgs_steps: int = 0
    lbfgs_iters: int = 20
    lbfgs_history: int = 50
    # sampled: past this many unique samples the gradient is re-evaluated in chunks of this size (memory of one
    # chunk's activations, ~0.1 MB per configuration; all of a 1.7 M sector's samples at once would need ~20 GB)
    grad_chunk: int = 16384
    # entropy annealing: minimise E - T*S(P), T decaying linearly to 0 over the first anneal_frac of the steps.
    # T0 = anneal * (spread of diagonal energies over the first step's samples), so one value fits all molecules.
    anneal: float = 0.07
    anneal_frac: float = 0.5
    sr: bool = False
    sr_shift: float = 1e-3  # diagonal shift of the minSR kernel, relative to its mean diagonal
    sr_max_configs: int = 512  # minSR kernel over at most this many (the most probable) configurations
    seed: int = 0
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    eval_exact_max: int = 100_000  # final evaluation sums over every configuration below this space size
    eval_samples: int | None = None  # otherwise samples this many (default 100 * samples)
    checkpoint_every: int = 100
    keep_last: int = 2  # checkpoints kept (the newest); 0 keeps all
    # step guard (exact- and selected-sum runs without annealing): from step ``rollback_after`` on, a step whose
    # energy lies more than ``rollback_tol_mha`` above the best seen restores the best state and halves the rate
    # (step_guard.py); the first steps after a warm start rise by 10 mHa or more by design, hence the late start.
    # 0 disables it.
    rollback_tol_mha: float = 10.0
    rollback_after: int = 200

    def __post_init__(self) -> None:
        if self.local_energy not in MODES:
            raise ValueError(f"VMCConfig.local_energy: {self.local_energy!r} not in {MODES}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"VMCConfig.estimator: {self.estimator!r} not in {ESTIMATORS}")
        if self.estimator in ("exact-sum", "selected-sum") and self.local_energy != "exact":
            raise ValueError(f"VMCConfig.estimator: {self.estimator!r} needs local_energy='exact' (it sums H psi "
                             "exactly)")
        if not 0 <= self.selected_min_prob < 1:
            raise ValueError(f"VMCConfig.selected_min_prob: must be in [0, 1), got {self.selected_min_prob}")
        if not 0 <= self.exact_tail < 1:
            raise ValueError(f"VMCConfig.exact_tail: must be in [0, 1), got {self.exact_tail}")
        if self.exact_max_configs < 1:
            raise ValueError(f"VMCConfig.exact_max_configs: must be >= 1, got {self.exact_max_configs}")
        if self.samples_final is not None and self.samples_final < self.samples:
            raise ValueError(f"VMCConfig.samples_final: must be >= samples ({self.samples}), got {self.samples_final}")
        for name, low in (("steps", 1), ("samples", 1), ("grad_chunk", 1), ("checkpoint_every", 1), ("keep_last", 0),
                          ("selected_expand", 0), ("selected_join_max", 1), ("selected_expand_every", 1),
                          ("selected_expand_max", 0), ("selected_sign_fit", 0), ("selected_sign_fit_every", 1),
                          ("lbfgs_steps", 0), ("lbfgs_iters", 1), ("lbfgs_history", 1),
                          ("warmup", 0), ("anneal", 0), ("rollback_tol_mha", 0), ("rollback_after", 0)):
            if not getattr(self, name) >= low:  # `not >=` also refuses NaN
                raise ValueError(f"VMCConfig.{name}: must be >= {low}, got {getattr(self, name)}")
        if self.sector_max < 0:
            raise ValueError(f"VMCConfig.sector_max: must be >= 0, got {self.sector_max}")
        if self.lr <= 0:
            raise ValueError(f"VMCConfig.lr: must be > 0, got {self.lr}")
