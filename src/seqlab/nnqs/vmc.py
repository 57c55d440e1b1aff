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

With ``estimator="exact-sum"`` (the default ``"auto"`` picks it whenever the sector fast path applies) the samples
are replaced by the most probable configurations of the whole sector with their exact probabilities as w_k, and E
by <psi|H|psi>/<psi|psi> over the whole sector (``exact_sum.py``): the same formulas, with no sampling noise.
Past the sector fast path ``"auto"`` takes ``"selected-sum"``: the same exact sum over the space S of every
configuration the sampler has drawn (``selected_space.py``), the energy of psi restricted to S.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.exact_sum import ExactSum, exact_sum, sector_log_psi, subspace_sum
from seqlab.nnqs.local_energy import PsiTable, SectorHamiltonian, local_energy
from seqlab.nnqs.sampler import sample, tree_log_prob
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.sign_fit import fit_signs
from seqlab.nnqs.space import keys_to_tokens, n_configurations, tokens_to_bits, tokens_to_keys
from seqlab.nnqs.sr import sr_direction
from seqlab.nnqs.vmc_config import VMCConfig  # the run's settings; callers import them from here too
from seqlab.runtime.dist import DistInfo, all_reduce_mean, all_reduce_sum, gather_bytes
from seqlab.runtime.schedule import warmup_cosine

HARTREE_TO_MHA = 1000.0
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
    tail_mass: float = 0.0  # exact sum: probability left out of the gradient set (0 when sampled)
    n_selected: int = 0  # selected sum: configurations in the selected space this step
    t_sign_fit: float = 0.0  # selected sum: seconds spent fitting the phase network to the space's signs
    n_joined: int = 0  # selected sum: sampled configurations that joined the space this step ...
    n_join_skipped: int = 0  # ... and new ones left out by ``VMCConfig.selected_join_max``
    # selected sum: psi's probability outside the space as summed (1 - sum over S of P; P is normalised over the
    # sector): what the energy over S cannot see, and what the next samples bring in
    outside_mass: float = 0.0
    n_evaluations: int = 1  # energy-and-gradient evaluations this step (L-BFGS: its line searches' too)


def step_generators(seed: int, step: int, rank: int) -> tuple[torch.Generator, torch.Generator]:
    shared = torch.Generator().manual_seed(1_000_003 * seed + step)
    local = torch.Generator().manual_seed(1_000_003 * seed + step + 7_919 * (rank + 1) * 1_000_000_007 % (2**62))
    return shared, local


def make_evaluator(wf: Wavefunction, batch: int = 65536):
    """log psi at configurations not yet seen (keys -> complex128): log P on their own prefix tree with the KV cache
    (``tree_log_prob``: shared prefixes read once, several times cheaper than a forward per configuration), the
    phase MLP in batches."""
    n = wf.n_orb

    @torch.no_grad()
    def evaluate(keys: Tensor) -> Tensor:
        tokens = keys_to_tokens(keys, n)
        phase = torch.cat([wf.phase(t) for t in tokens.split(batch)]) if len(tokens) else torch.empty(0)
        return torch.complex(0.5 * tree_log_prob(wf, tokens, batch).double(), phase.double())

    return evaluate


def build_sector(ham: Hamiltonian, cfg: VMCConfig, dist: DistInfo) -> SectorHamiltonian | None:
    """H over the whole sector when exact local energies may take the sector fast path (see ``sector_max``); the
    selected sum never reads it."""
    if (cfg.local_energy != "exact" or cfg.estimator == "selected-sum"
            or n_configurations(ham.n_orb, ham.n_alpha, ham.n_beta) > cfg.sector_max):
        return None
    return SectorHamiltonian(ham, progress=dist.is_main)


EXACT_SUM_HINT = "use 'selected-sum', 'sampled' or 'auto'"


def check_exact_sum_fits(estimator: str, n_configurations: int, name: str,
                         sector_max: int = VMCConfig.sector_max) -> None:
    """Refuse ``estimator`` 'exact-sum' on a sector past the fast path from the counts alone (``name``: the flag or
    field to blame): the CLI asks before the SCF and the references, which take most of a minute on H2O/6-31G."""
    if estimator == "exact-sum" and n_configurations > sector_max:
        raise ValueError(f"{name}: 'exact-sum' needs the sector fast path (a sector of at most sector_max = "
                         f"{sector_max} configurations; this one has {n_configurations}); {EXACT_SUM_HINT}")


def uses_exact_sum(cfg: VMCConfig, sector: SectorHamiltonian | None) -> bool:
    """Whether steps take the exact-sum estimator (``cfg.estimator`` and whether the sector fast path is on)."""
    if cfg.estimator == "exact-sum" and sector is None:
        raise ValueError(f"VMCConfig.estimator: 'exact-sum' needs the sector fast path (a sector of at most "
                         f"sector_max = {cfg.sector_max} configurations); {EXACT_SUM_HINT}")
    return sector is not None and cfg.estimator in ("auto", "exact-sum")


def takes_selected_sum(estimator: str, local_energy: str, n_configurations: int, sector_max: int) -> bool:
    """Whether steps take the selected-sum estimator: asked for, or ``auto`` with exact local energies past the sector
    fast path (``sector_max`` > 0: a disabled fast path keeps the per-sample path, for comparisons). The CLI asks
    before it builds anything, to pick the recipe that goes with it."""
    return estimator == "selected-sum" or (estimator == "auto" and local_energy == "exact"
                                           and 0 < sector_max < n_configurations)


def build_selected(ham: Hamiltonian, cfg: VMCConfig) -> SelectedSpace | None:
    """An empty selected space when steps take the selected-sum estimator (``takes_selected_sum``)."""
    n = n_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)
    return SelectedSpace(ham) if takes_selected_sum(cfg.estimator, cfg.local_energy, n, cfg.sector_max) else None


def vmc_step(wf: Wavefunction, ham: Hamiltonian, opt: torch.optim.Optimizer, cfg: VMCConfig, step: int,
             dist: DistInfo, t0: float = 0.0, sector: SectorHamiltonian | None = None,
             selected: SelectedSpace | None = None) -> StepStats:
    """One optimizer step; ``t0`` is the initial annealing temperature (see ``initial_temperature``).

    With ``sector`` (from ``build_sector``) exact local energies take the sector fast path (the same values), and
    the estimator is the exact sum unless ``cfg.estimator`` is "sampled". With ``selected`` (from ``build_selected``)
    the step draws N_s samples into that space and sums exactly over it.
    """
    t_0 = time.perf_counter()
    tail, n_selected, t_sign_fit, joined, skipped, outside = 0.0, 0, 0.0, 0, 0, 0.0
    if selected is not None:
        t_sign_fit, joined, skipped = refit_signs_and_sample(wf, selected, cfg, step, dist)
        t1 = time.perf_counter()
        summed = selected.keys
        log_psi = make_evaluator(wf)(summed)
        outside = outside_mass(log_psi)
        ex = subspace_sum(log_psi, selected.hamiltonian(), cfg.exact_tail, cfg.exact_max_configs, dist.rank,
                          dist.world_size)
        n_selected = len(ex.probabilities)
        prune_and_expand(selected, cfg, step, summed, log_psi, ex)  # for the next step; this one sums over all
        tokens, w, eloc, tail = ex.tokens, ex.weights, ex.eloc, ex.tail_mass
        (e_re, e_im), var, n_unique, sigma = (ex.energy.real, ex.energy.imag), ex.variance, ex.n_kept, 0.0
        logp, phase = wf(tokens) if len(tokens) else (torch.zeros(0), torch.zeros(0))
    elif uses_exact_sum(cfg, sector):
        ex = exact_sum(wf, sector, cfg.exact_tail, cfg.exact_max_configs, dist.rank, dist.world_size)
        tokens, w, eloc, tail = ex.tokens, ex.weights, ex.eloc, ex.tail_mass
        (e_re, e_im), var, n_unique, sigma = (ex.energy.real, ex.energy.imag), ex.variance, ex.n_kept, 0.0
        t1 = time.perf_counter()
        logp, phase = wf(tokens) if len(tokens) else (torch.zeros(0), torch.zeros(0))
    else:
        shared, local = step_generators(cfg.seed, step, dist.rank)
        s = sample(wf, samples_at(cfg, step), shared, cfg.sampler, dist.rank, dist.world_size, local)
        t1 = time.perf_counter()
        tokens, w = s.tokens, s.counts.double() / s.n_total
        logp, phase, eloc = sampled_local_energy(wf, ham, cfg, tokens, sector, dist)
        sums = torch.stack(((w * eloc.real).sum(), (w * eloc.imag).sum(), (w * eloc.abs() ** 2).sum(),
                            torch.tensor(float(len(tokens)), dtype=torch.float64)))
        all_reduce_sum(sums, dist)
        e_re, e_im, e2, n_unique = (float(v) for v in sums)
        var = max(e2 - e_re**2 - e_im**2, 0.0)
        sigma = math.sqrt(var / s.n_total)
    t2 = time.perf_counter()
    de = eloc - complex(e_re, e_im)
    opt.zero_grad(set_to_none=True)
    if cfg.sr:  # on the most probable configurations (the Jacobian costs ~3 ms per configuration)
        top = torch.argsort(w, descending=True, stable=True)[: cfg.sr_max_configs]
        sr_direction(wf, tokens[top], w[top], eloc[top], complex(e_re, e_im), cfg.sr_shift)
    else:
        a = de.real
        temp = temperature_at(cfg, step, t0)
        if temp > 0:  # d(T * sum P log P) = T * E[(log P - <log P>) d log P]
            lp = logp.detach().double()
            sums = all_reduce_sum(torch.stack(((w * lp).sum(), w.sum())), dist)
            a = a + temp * (lp - sums[0] / sums[1])  # (exact sum: the mean over the gradient set)
        if len(tokens):
            backward_surrogate(wf, tokens, logp, phase, w * a, w * 2 * de.imag, cfg.grad_chunk)
    reduce_gradients(wf, dist, cfg.grad_clip)
    lr = lr_at(cfg, step)
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    opt.step()
    t3 = time.perf_counter()
    return StepStats(step, e_re, e_im, sigma, var, int(n_unique), lr, t1 - t_0 - t_sign_fit, t2 - t1, t3 - t2,
                     temperature_at(cfg, step, t0), tail, n_selected, t_sign_fit, joined, skipped, outside)


def refit_signs_and_sample(wf: Wavefunction, selected: SelectedSpace, cfg: VMCConfig, step: int,
                           dist: DistInfo) -> tuple[float, int, int]:
    """A selected-sum step's start: the sign fit when it is due, then N_s samples join S, at most
    ``cfg.selected_join_max`` new ones (the most often drawn); returns the fit's seconds (0 when there was none), how
    many joined and how many new ones the cap left out."""
    t_sign_fit = 0.0
    if cfg.selected_sign_fit and step % cfg.selected_sign_fit_every == 0 and len(selected):
        t_fit = time.perf_counter()
        fit_space_signs(wf, selected, cfg.selected_sign_fit, dist)
        t_sign_fit = time.perf_counter() - t_fit
    shared, _ = step_generators(cfg.seed, step, 0)
    s = sample(wf, samples_at(cfg, step), shared, cfg.sampler)  # every rank draws the same tree: the same S
    keys = tokens_to_keys(s.tokens)  # unique, with their counts
    new = ~selected.contains(keys)
    keys, counts = keys[new], s.counts[new]
    skipped = max(0, len(keys) - cfg.selected_join_max)
    if skipped:  # the same order on every rank: the same tree, and a stable sort
        keys = keys[torch.argsort(counts, descending=True, stable=True)[: cfg.selected_join_max]]
    return t_sign_fit, selected.add(keys), skipped


def outside_mass(log_psi: Tensor) -> float:
    """psi's probability outside a space, from log psi over all of it (P is normalised over the whole sector)."""
    return max(0.0, 1.0 - float(torch.exp(2 * log_psi.real).sum()))


def prune_and_expand(selected: SelectedSpace, cfg: VMCConfig, step: int, summed: Tensor, log_psi: Tensor,
                     ex: ExactSum) -> bool:
    """A selected-sum step's end, from psi over the space as it was summed (``summed``, ``log_psi``, ``ex``): drop
    the improbable configurations and, when due, expand; returns whether it expanded."""
    keep = ex.probabilities >= cfg.selected_min_prob
    keep[ex.probabilities.argmax()] = True  # never an empty space, whatever the threshold
    selected.keep(keep)
    room = cfg.selected_expand_max - selected.n_expanded
    if not (cfg.selected_expand and step % cfg.selected_expand_every == 0 and room > 0):
        return False
    selected.expand(summed, log_psi, ex.energy.real, min(cfg.selected_expand, room))
    return True


def reduce_gradients(wf: Wavefunction, dist: DistInfo, clip: float | None = None) -> None:
    """Sum every rank's gradient into every rank's ``.grad`` (then clip the global norm to ``clip``, the same on every
    rank)."""
    params = list(wf.parameters())
    for p in params:  # a rank whose share of the tree is empty still joins the all-reduce
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in params])
    all_reduce_sum(flat, dist)
    if clip:
        flat.mul_(min(1.0, clip / (float(flat.norm()) + 1e-12)))
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def fit_space_signs(wf: Wavefunction, selected: SelectedSpace, steps: int, dist: DistInfo) -> None:
    """Fit the phase network to the signs of H's ground state on ``selected`` (``sign_fit.py``). Every rank fits
    the same numbers on the same space; the mean over ranks afterwards keeps them bit-identical regardless."""
    _, coeffs = selected.ground_state()
    fit_signs(wf, selected.hamiltonian().tokens, coeffs, steps)
    for p in wf.phase_net.parameters():
        all_reduce_mean(p.data, dist)


def backward_surrogate(wf: Wavefunction, tokens: Tensor, logp: Tensor, phase: Tensor, c_logp: Tensor,
                       c_phase: Tensor, chunk: int) -> None:
    """Accumulate d/dtheta sum(c_logp log P + c_phase phi): through the graph ``logp`` and ``phase`` carry, or, where
    they were computed without one (more than ``chunk`` samples), by re-running the network chunk by chunk."""
    if logp.requires_grad:
        (c_logp * logp.double() + c_phase * phase.double()).sum().backward()
        return
    for rows in torch.arange(len(tokens)).split(chunk):
        lp, ph = wf(tokens[rows])
        (c_logp[rows] * lp.double() + c_phase[rows] * ph.double()).sum().backward()


def sampled_local_energy(wf: Wavefunction, ham: Hamiltonian, cfg: VMCConfig, tokens: Tensor,
                         sector: SectorHamiltonian | None,
                         dist: DistInfo | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(log P, phi) with gradients and exact (or sample-space) E_loc for this rank's unique samples. The sample-space
    estimator keeps the x' among every rank's samples, so its truncation of H does not narrow with more ranks."""
    keys = tokens_to_keys(tokens) if len(tokens) else torch.zeros(0, dtype=torch.int64)
    if len(tokens) > cfg.grad_chunk:  # no graph now: backward_surrogate re-runs the network in chunks
        log_psi = wf.log_psi(tokens, cfg.grad_chunk)
        logp, phase = (2 * log_psi.real).float(), log_psi.imag.float()
    elif len(tokens):
        logp, phase = wf(tokens)
    else:  # this rank's share of the sample tree is empty (tiny spaces, many ranks)
        logp, phase = torch.zeros(0), torch.zeros(0)
    with torch.no_grad():
        log_psi = torch.complex(0.5 * logp.detach().double(), phase.detach().double())
        sampled = (keys, log_psi)
        if cfg.local_energy == "sample-space":  # every rank takes part, an empty share too
            sampled = every_rank_samples(keys, log_psi, dist or DistInfo())
        if not len(tokens):
            return logp, phase, torch.zeros(0, dtype=torch.complex128)
        if sector is not None and cfg.local_energy == "exact":
            return logp, phase, sector.local_energy(keys, sector_log_psi(wf, sector))
        return logp, phase, local_energy(ham, keys, log_psi, PsiTable(*sampled), make_evaluator(wf),
                                         cfg.local_energy)


def every_rank_samples(keys: Tensor, log_psi: Tensor, dist: DistInfo) -> tuple[Tensor, Tensor]:
    """(keys, log psi) of the unique samples of all ranks (their shares of the sample tree are disjoint)."""
    if not dist.active:
        return keys, log_psi
    parts = gather_bytes(keys.numpy().tobytes() + log_psi.numpy().tobytes(), dist)
    counts = [len(part) // 24 for part in parts]  # 8 bytes of key and 16 of complex128 per sample
    keys = [_from_bytes(part[: 8 * n], torch.int64) for part, n in zip(parts, counts)]
    values = [_from_bytes(part[8 * n:], torch.complex128) for part, n in zip(parts, counts)]
    return torch.cat(keys), torch.cat(values)


def _from_bytes(buffer: bytes, dtype: torch.dtype) -> Tensor:
    return torch.frombuffer(bytearray(buffer), dtype=dtype) if buffer else torch.zeros(0, dtype=dtype)


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
