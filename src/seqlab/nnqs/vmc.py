"""One VMC step: sample -> local energies -> energy and gradient -> optimizer step (the driver is ``driver.py``).

With weights w_k = n_k / N_s from the sampler's unique configurations and counts,

    E     = sum_k w_k E_loc(x_k)                       sigma = sqrt(Var_w[E_loc] / N_s)
    dE/dθ = 2 Re sum_k w_k (E_loc(x_k) - E)^* d log psi(x_k)/dθ

(samples from an autoregressive model are independent, so no autocorrelation correction). With
log psi = 1/2 log P + i phi the gradient is that of the surrogate loss

    L = sum_k w_k [ Re(E_loc - E) log P(x_k) + 2 Im(E_loc - E) phi(x_k) ]     (E_loc, E held constant)

which is what ``backward`` sees. Ranks hold disjoint parts of one sample tree; the sums above (and the gradient)
are all-reduced, so every rank takes the same optimizer step. Optional stochastic reconfiguration (``sr=True``)
preconditions the gradient with the quantum geometric tensor in its sample-space (minSR) form.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.local_energy import MODES, PsiTable, SectorHamiltonian, local_energy
from seqlab.nnqs.sampler import SamplerConfig, enumerate_log_prob, sample
from seqlab.nnqs.space import keys_to_tokens, n_configurations, tokens_to_bits, tokens_to_keys
from seqlab.nnqs.sr import sr_direction
from seqlab.runtime.dist import DistInfo, all_reduce_sum
from seqlab.runtime.schedule import warmup_cosine

HARTREE_TO_MHA = 1000.0


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
    # entropy annealing: minimise E - T*S(P), T decaying linearly to 0 over the first anneal_frac of the steps.
    # T0 = anneal * (spread of diagonal energies over the first step's samples), so one value fits all molecules.
    anneal: float = 0.07
    anneal_frac: float = 0.5
    sr: bool = False
    sr_shift: float = 1e-3  # diagonal shift of the minSR kernel, relative to its mean diagonal
    seed: int = 0
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    eval_exact_max: int = 100_000  # final evaluation sums over every configuration below this space size
    eval_samples: int | None = None  # otherwise samples this many (default 100 * samples)
    checkpoint_every: int = 100
    keep_last: int = 2  # checkpoints kept (the newest); 0 keeps all

    def __post_init__(self) -> None:
        if self.local_energy not in MODES:
            raise ValueError(f"VMCConfig.local_energy: {self.local_energy!r} not in {MODES}")
        if self.samples_final is not None and self.samples_final < self.samples:
            raise ValueError(f"VMCConfig.samples_final: must be >= samples ({self.samples}), got {self.samples_final}")
        for name, low in (("steps", 1), ("samples", 1), ("checkpoint_every", 1), ("keep_last", 0), ("warmup", 0),
                          ("anneal", 0)):
            if not getattr(self, name) >= low:  # `not >=` also refuses NaN
                raise ValueError(f"VMCConfig.{name}: must be >= {low}, got {getattr(self, name)}")
        if self.sector_max < 0:
            raise ValueError(f"VMCConfig.sector_max: must be >= 0, got {self.sector_max}")
        if self.lr <= 0:
            raise ValueError(f"VMCConfig.lr: must be > 0, got {self.lr}")


def temperature_at(cfg: VMCConfig, step: int, t0: float) -> float:
    end = cfg.anneal_frac * cfg.steps
    return t0 * max(0.0, 1.0 - step / end) if end > 0 else 0.0


def samples_at(cfg: VMCConfig, step: int) -> int:
    """N_s of a step: ``samples``, or the geometric ramp from ``samples`` to ``samples_final``."""
    if cfg.samples_final is None or cfg.steps < 2:
        return cfg.samples
    frac = min(step, cfg.steps - 1) / (cfg.steps - 1)
    return int(round(cfg.samples * (cfg.samples_final / cfg.samples) ** frac))


def lr_at(cfg: VMCConfig, step: int) -> float:
    """The runtime's warmup-cosine, ending at ``lr * min_lr_ratio`` on the *last* step (index ``steps - 1``)."""
    return warmup_cosine(step, cfg.steps - 1, cfg.lr, cfg.warmup, cfg.min_lr_ratio)


@dataclass
class StepStats:
    step: int
    energy: float
    energy_imag: float
    energy_std: float
    variance: float
    n_unique: int  # over all ranks
    lr: float
    t_sample: float
    t_local_energy: float
    t_backward: float
    temperature: float = 0.0


def step_generators(seed: int, step: int, rank: int) -> tuple[torch.Generator, torch.Generator]:
    shared = torch.Generator().manual_seed(1_000_003 * seed + step)
    local = torch.Generator().manual_seed(1_000_003 * seed + step + 7_919 * (rank + 1) * 1_000_000_007 % (2**62))
    return shared, local


def make_evaluator(wf: Wavefunction):
    n = wf.n_orb

    def evaluate(keys: Tensor) -> Tensor:
        return wf.log_psi(keys_to_tokens(keys, n))

    return evaluate


def build_sector(ham: Hamiltonian, cfg: VMCConfig, dist: DistInfo) -> SectorHamiltonian | None:
    """H over the whole sector when exact local energies may take the sector fast path (see ``sector_max``)."""
    if cfg.local_energy != "exact" or n_configurations(ham.n_orb, ham.n_alpha, ham.n_beta) > cfg.sector_max:
        return None
    return SectorHamiltonian(ham, progress=dist.is_main)


@torch.no_grad()
def sector_log_psi(wf: Wavefunction, sector: SectorHamiltonian) -> Tensor:
    """log psi [D] complex128 on every sector configuration, in ``sector.keys`` order.

    log P comes from walking the whole prefix tree on the KV cache (``enumerate_log_prob``), cheaper than one
    parallel forward over the finished configurations because shared prefixes are read once; the phase MLP runs on all of them in one batch. Every rank
    evaluates the whole sector itself (no communication; it needs the rows of its own samples only).
    """
    tokens, logp = enumerate_log_prob(wf)
    pos, found = sector.find(tokens_to_keys(tokens))
    assert len(pos) == len(sector) and bool(found.all())
    out = torch.empty(len(sector), dtype=torch.complex128)
    out[pos] = torch.complex(0.5 * logp.double(), wf.phase(tokens).double())
    return out


def vmc_step(wf: Wavefunction, ham: Hamiltonian, opt: torch.optim.Optimizer, cfg: VMCConfig, step: int,
             dist: DistInfo, t0: float = 0.0, sector: SectorHamiltonian | None = None) -> StepStats:
    """One optimizer step; ``t0`` is the initial annealing temperature (see ``initial_temperature``).

    With ``sector`` (from ``build_sector``) exact local energies take the sector fast path; the result is the same.
    """
    t_0 = time.perf_counter()
    shared, local = step_generators(cfg.seed, step, dist.rank)
    s = sample(wf, samples_at(cfg, step), shared, cfg.sampler, dist.rank, dist.world_size, local)
    t1 = time.perf_counter()
    keys = tokens_to_keys(s.tokens)
    if len(keys):
        logp, phase = wf(s.tokens)
        log_psi = torch.complex(0.5 * logp.detach().double(), phase.detach().double())
        with torch.no_grad():
            if sector is not None and cfg.local_energy == "exact":
                eloc = sector.local_energy(keys, sector_log_psi(wf, sector))
            else:
                eloc = local_energy(ham, keys, log_psi, PsiTable(keys, log_psi), make_evaluator(wf),
                                    cfg.local_energy)
    else:  # this rank's share of the sample tree is empty (tiny spaces, many ranks)
        logp = phase = torch.zeros(0)
        eloc = torch.zeros(0, dtype=torch.complex128)
    t2 = time.perf_counter()
    w = s.counts.double() / s.n_total
    sums = torch.stack(((w * eloc.real).sum(), (w * eloc.imag).sum(), (w * eloc.abs() ** 2).sum(),
                        torch.tensor(float(len(keys)), dtype=torch.float64)))
    all_reduce_sum(sums, dist)
    e_re, e_im, e2, n_unique = (float(v) for v in sums)
    var = max(e2 - e_re**2 - e_im**2, 0.0)
    de = eloc - complex(e_re, e_im)
    opt.zero_grad(set_to_none=True)
    if cfg.sr:
        sr_direction(wf, s.tokens, w, eloc, complex(e_re, e_im), cfg.sr_shift)
    else:
        a = de.real
        temp = temperature_at(cfg, step, t0)
        if temp > 0:  # d(T * sum P log P) = T * E[(log P - <log P>) d log P]
            lp = logp.detach().double()
            mean_lp = all_reduce_sum((w * lp).sum().reshape(1), dist)[0]
            a = a + temp * (lp - mean_lp)
        if len(keys):
            loss = (w * (a * logp.double() + 2 * de.imag * phase.double())).sum()
            loss.backward()
    params = list(wf.parameters())
    for p in params:  # a rank whose share of the tree is empty still joins the all-reduce
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in params])
    all_reduce_sum(flat, dist)
    if cfg.grad_clip:  # global-norm clipping (same on every rank: after the all-reduce)
        flat.mul_(min(1.0, cfg.grad_clip / (float(flat.norm()) + 1e-12)))
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    lr = lr_at(cfg, step)
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    opt.step()
    t3 = time.perf_counter()
    return StepStats(step, e_re, e_im, math.sqrt(var / s.n_total), var, int(n_unique), lr, t1 - t_0, t2 - t1,
                     t3 - t2, temperature_at(cfg, step, t0))


@torch.no_grad()
def initial_temperature(wf: Wavefunction, ham: Hamiltonian, cfg: VMCConfig, dist: DistInfo) -> float:
    """T0 = anneal * (mean - min) of H[x,x] over a sample of the initial (nearly uniform) wavefunction.

    That spread is the energy scale the first steps work against (tens of Ha for H2O, a few for LiH); tying T0 to
    it keeps the distribution broad long enough for the phase to learn the sign structure before P concentrates
    near Hartree-Fock, where the phase gradient (proportional to the amplitudes of excited configurations)
    vanishes. Computed identically on every rank (shared seed, all leaves).
    """
    if cfg.anneal <= 0:
        return 0.0
    gen = torch.Generator().manual_seed(cfg.seed)
    s = sample(wf, min(cfg.samples, 100_000), gen, cfg.sampler)
    diag = ham.diagonal(tokens_to_bits(s.tokens))
    w = s.counts.double() / s.counts.sum()
    return cfg.anneal * float((w * diag).sum() - diag.min())
