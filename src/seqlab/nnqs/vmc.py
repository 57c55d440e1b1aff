"""Variational Monte Carlo: sample -> local energies -> energy and gradient -> optimizer step.

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

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from seqlab.runtime import atomic_write_text
from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.distributed import Dist
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.local_energy import MODES, PsiTable, SectorHamiltonian, local_energy
from seqlab.nnqs.sampler import SamplerConfig, enumerate_log_prob, sample
from seqlab.nnqs.space import all_configurations, keys_to_tokens, n_configurations, tokens_to_bits, tokens_to_keys

HARTREE_TO_MHA = 1000.0


@dataclass
class VMCConfig:
    steps: int = 400
    samples: int = 10**10  # N_s per step, over all ranks (only unique configurations cost compute)
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
    # whole sector (prefix tree on the KV cache), and memory <= ~12 bytes x N_conf x (singles + doubles): 22 MiB for N2.
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

    def __post_init__(self) -> None:
        if self.local_energy not in MODES:
            raise ValueError(f"VMCConfig.local_energy: {self.local_energy!r} not in {MODES}")
        for name in ("steps", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"VMCConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if self.sector_max < 0:
            raise ValueError(f"VMCConfig.sector_max: must be >= 0, got {self.sector_max}")
        if self.lr <= 0:
            raise ValueError(f"VMCConfig.lr: must be > 0, got {self.lr}")


def temperature_at(cfg: VMCConfig, step: int, t0: float) -> float:
    end = cfg.anneal_frac * cfg.steps
    return t0 * max(0.0, 1.0 - step / end) if end > 0 else 0.0


def lr_at(cfg: VMCConfig, step: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / (cfg.warmup + 1)
    p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (1 + math.cos(math.pi * p)) * (cfg.lr - lo)


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


def _generators(seed: int, step: int, rank: int) -> tuple[torch.Generator, torch.Generator]:
    shared = torch.Generator().manual_seed(1_000_003 * seed + step)
    local = torch.Generator().manual_seed(1_000_003 * seed + step + 7_919 * (rank + 1) * 1_000_000_007 % (2**62))
    return shared, local


def make_evaluator(wf: Wavefunction):
    n = wf.n_orb

    def evaluate(keys: Tensor) -> Tensor:
        return wf.log_psi(keys_to_tokens(keys, n))

    return evaluate


def build_sector(ham: Hamiltonian, cfg: VMCConfig, dist: Dist) -> SectorHamiltonian | None:
    """H over the whole sector when exact local energies may take the sector fast path (see ``sector_max``)."""
    if cfg.local_energy != "exact" or n_configurations(ham.n_orb, ham.n_alpha, ham.n_beta) > cfg.sector_max:
        return None
    return SectorHamiltonian(ham, progress=dist.is_main)


@torch.no_grad()
def sector_log_psi(wf: Wavefunction, sector: SectorHamiltonian) -> Tensor:
    """log psi [D] complex128 on every sector configuration, in ``sector.keys`` order.

    log P comes from walking the whole prefix tree on the KV cache (``enumerate_log_prob``), ~4x cheaper than one
    parallel forward over the finished configurations; the phase MLP runs on all of them in one batch. Every rank
    evaluates the whole sector itself (no communication; it needs the rows of its own samples only).
    """
    tokens, logp = enumerate_log_prob(wf)
    pos, found = sector.find(tokens_to_keys(tokens))
    assert len(pos) == len(sector) and bool(found.all())
    out = torch.empty(len(sector), dtype=torch.complex128)
    out[pos] = torch.complex(0.5 * logp.double(), wf.phase(tokens).double())
    return out


def _sr_direction(wf: Wavefunction, tokens: Tensor, w: Tensor, eloc: Tensor, energy: complex, shift: float) -> None:
    """Replace .grad by the minSR natural-gradient direction (single process; U x U kernel).

    O_k = d log psi(x_k)/dθ (complex), centred and scaled by sqrt(w_k): the update solves
    (S + shift) δ = F in parameter space through the U x U kernel T = O O^† (cheap when U << n_params).
    """
    params = [p for p in wf.parameters() if p.requires_grad]
    rows_re, rows_im = [], []
    for k in range(len(tokens)):  # per-sample gradients; SR is meant for small sample sets
        lp, ph = wf(tokens[k : k + 1])
        g_re = torch.autograd.grad(0.5 * lp.sum(), params, allow_unused=True)
        g_im = torch.autograd.grad(ph.sum(), params, allow_unused=True)
        rows_re.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(g_re, params)]))
        rows_im.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(g_im, params)]))
    O = torch.complex(torch.stack(rows_re).double(), torch.stack(rows_im).double())
    sw = w.sqrt()[:, None]
    O = sw * (O - (w[:, None] * O).sum(0, keepdim=True))
    eps = sw.squeeze(1) * (eloc - energy)  # centred, weighted local energies
    # real parametrisation: stack real and imaginary parts (S and F are real for real parameters)
    Or = torch.cat((O.real, O.imag), 0)
    er = torch.cat((eps.real, eps.imag), 0)
    T = Or @ Or.T
    T = T + shift * T.diagonal().mean().clamp_min(1e-12) * torch.eye(len(T), dtype=T.dtype)
    delta = Or.T @ torch.linalg.solve(T, er)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = delta[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def vmc_step(wf: Wavefunction, ham: Hamiltonian, opt: torch.optim.Optimizer, cfg: VMCConfig, step: int,
             dist: Dist, t0: float = 0.0, sector: SectorHamiltonian | None = None) -> StepStats:
    """One optimizer step; ``t0`` is the initial annealing temperature (see ``initial_temperature``).

    With ``sector`` (from ``build_sector``) exact local energies take the sector fast path; the result is the same.
    """
    t_0 = time.perf_counter()
    shared, local = _generators(cfg.seed, step, dist.rank)
    s = sample(wf, cfg.samples, shared, cfg.sampler, dist.rank, dist.world_size, local)
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
    dist.all_reduce(sums)
    e_re, e_im, e2, n_unique = (float(v) for v in sums)
    var = max(e2 - e_re**2 - e_im**2, 0.0)
    de = eloc - complex(e_re, e_im)
    opt.zero_grad(set_to_none=True)
    if cfg.sr:
        _sr_direction(wf, s.tokens, w, eloc, complex(e_re, e_im), cfg.sr_shift)
    else:
        a = de.real
        temp = temperature_at(cfg, step, t0)
        if temp > 0:  # d(T * sum P log P) = T * E[(log P - <log P>) d log P]
            lp = logp.detach().double()
            mean_lp = dist.all_reduce((w * lp).sum().reshape(1))[0]
            a = a + temp * (lp - mean_lp)
        if len(keys):
            loss = (w * (a * logp.double() + 2 * de.imag * phase.double())).sum()
            loss.backward()
    params = list(wf.parameters())
    for p in params:  # a rank whose share of the tree is empty still joins the all-reduce
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat)
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
def initial_temperature(wf: Wavefunction, ham: Hamiltonian, cfg: VMCConfig, dist: Dist) -> float:
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


@torch.no_grad()
def evaluate_energy(wf: Wavefunction, ham: Hamiltonian, cfg: VMCConfig, dist: Dist, seed: int = 12345) -> dict:
    """Final energy: exact sum over the whole space when it is small, else a large sample (exact local energies).

    Deliberately on the per-sample enumeration path, not the sector fast path used in training: the reported
    energy is then an independent check of it (and the one-off cost is small).
    """
    n_conf = n_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)
    evaluate = make_evaluator(wf)
    if n_conf <= cfg.eval_exact_max:
        tokens = all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)
        keys = tokens_to_keys(tokens)
        log_psi = wf.log_psi(tokens)
        table = PsiTable(keys, log_psi)
        mine = torch.arange(dist.rank, len(keys), dist.world_size)
        p = torch.exp(2 * log_psi.real[mine])
        eloc = local_energy(ham, keys[mine], log_psi[mine], table, evaluate, "exact")
        sums = torch.stack(((p * eloc.real).sum(), (p * eloc.abs() ** 2).sum(), p.sum()))
        dist.all_reduce(sums)
        e, e2, psum = (float(v) for v in sums)
        e, e2 = e / psum, e2 / psum  # psum == 1 up to float32 round-off of log P; normalising removes it
        return {"energy": e, "energy_std": 0.0, "variance": max(e2 - e * e, 0.0), "final_eval": "exact",
                "final_eval_samples": None, "n_configurations": n_conf, "prob_sum": psum}
    n_s = cfg.eval_samples or 100 * cfg.samples
    shared, local = _generators(seed, 0, dist.rank)
    s = sample(wf, n_s, shared, cfg.sampler, dist.rank, dist.world_size, local)
    keys = tokens_to_keys(s.tokens)
    log_psi = wf.log_psi(s.tokens)
    eloc = (local_energy(ham, keys, log_psi, PsiTable(keys, log_psi), evaluate, "exact") if len(keys)
            else torch.zeros(0, dtype=torch.complex128))
    w = s.counts.double() / n_s
    sums = torch.stack(((w * eloc.real).sum(), (w * eloc.abs() ** 2).sum()))
    dist.all_reduce(sums)
    e, e2 = (float(v) for v in sums)
    var = max(e2 - e * e, 0.0)
    return {"energy": e, "energy_std": math.sqrt(var / n_s), "variance": var, "final_eval": "sampled",
            "final_eval_samples": n_s, "n_configurations": n_conf, "prob_sum": None}


# --- files ---------------------------------------------------------------------------------------------------


def save_checkpoint(out: Path, wf: Wavefunction, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    """model.safetensors + optimizer.pt (tensors only; loaded with weights_only=True) + state.json."""
    from safetensors.torch import save_file

    ck = out / "checkpoint"
    ck.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=ck, prefix=".model.")
    os.close(fd)
    save_file({k: v.contiguous() for k, v in wf.state_dict().items()}, tmp)
    os.replace(tmp, ck / "model.safetensors")
    fd, tmp = tempfile.mkstemp(dir=ck, prefix=".optimizer.")
    os.close(fd)
    torch.save(opt.state_dict(), tmp)
    os.replace(tmp, ck / "optimizer.pt")
    atomic_write_text(ck / "state.json", json.dumps({"step": step, **wf.config_dict(), **extra}, indent=2) + "\n")


def load_checkpoint(out: Path, wf: Wavefunction, opt: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from ``out/checkpoint``; returns the number of completed steps."""
    from safetensors.torch import load_file

    ck = out / "checkpoint"
    state = json.loads((ck / "state.json").read_text())
    if (state["n_orb"], state["n_alpha"], state["n_beta"]) != (wf.n_orb, wf.n_alpha, wf.n_beta):
        raise ValueError(f"{ck / 'state.json'}: checkpoint is for a different molecule "
                         f"(n_orb, N_alpha, N_beta) = {(state['n_orb'], state['n_alpha'], state['n_beta'])}")
    if state["ansatz"] != asdict(wf.cfg):
        raise ValueError(f"{ck / 'state.json'}: checkpoint ansatz {state['ansatz']} != requested {asdict(wf.cfg)}")
    wf.load_state_dict(load_file(ck / "model.safetensors"))
    opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
    return int(state["step"])


def plot_convergence(path: Path, records: list[dict], e_fci: float | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    e = [r["energy"] for r in records]
    sd = [r["energy_std"] for r in records]
    fig, axes = plt.subplots(1, 2 if e_fci is not None else 1, figsize=(11 if e_fci is not None else 6, 4))
    ax = axes[0] if e_fci is not None else axes
    ax.errorbar(steps, e, yerr=sd, fmt=".", ms=2, lw=0.5, label="NNQS (step estimate)")
    if e_fci is not None:
        ax.axhline(e_fci, color="k", lw=1, label="FCI")
        lo = min(e_fci, min(e)) - 0.01
        ax.set_ylim(lo, max(e_fci + 0.2, lo + 0.05))
    ax.set_xlabel("step")
    ax.set_ylabel("energy (Ha)")
    ax.legend()
    if e_fci is not None:
        err = [max(abs(v - e_fci) * HARTREE_TO_MHA, 1e-3) for v in e]
        axes[1].semilogy(steps, err, ".", ms=2)
        axes[1].axhline(1.6, color="r", lw=1, label="chemical accuracy (1.6 mHa)")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("|E - E_FCI| (mHa)")
        axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# --- the driver ----------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    wavefunction: Wavefunction
    records: list[dict]
    final: dict
    wall_time_s: float


def run_vmc(ham: Hamiltonian, cfg: VMCConfig, ansatz: AnsatzConfig | None = None, out: str | Path | None = None,
            dist: Dist | None = None, e_ref: float | None = None, resume: bool = False, callback=None,
            title: str = "NNQS") -> RunResult:
    """Train a fresh (or resumed) wavefunction for ``cfg.steps`` steps, then evaluate its energy.

    Writes (on rank 0, when ``out`` is given): energies.jsonl (one line per step), checkpoint/ every
    ``checkpoint_every`` steps and at the end, convergence.png. ``callback(stats)`` is called after every step.
    """
    dist = dist or Dist()
    if cfg.sr and dist.world_size > 1:
        raise ValueError("VMCConfig.sr: stochastic reconfiguration is implemented for one process only")
    out = Path(out) if out is not None else None
    torch.manual_seed(cfg.seed)  # identical initial parameters on every rank
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, ansatz)
    groups = [{"params": list(wf.decoder.parameters()), "lr_scale": 1.0},
              {"params": list(wf.phase_net.parameters()), "lr_scale": cfg.phase_lr_scale}]
    if cfg.sr:  # the natural-gradient direction is already preconditioned: plain steps along it
        opt = torch.optim.SGD(groups, lr=cfg.lr)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    start_step, records = 0, []
    if resume and out is not None and (out / "checkpoint" / "state.json").exists():
        start_step = load_checkpoint(out, wf, opt)
        log = out / "energies.jsonl"
        if log.exists():
            records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()][:start_step]
    log_f = None
    if out is not None and dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "energies.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        log_f = open(out / "energies.jsonl", "a")
    t_start = time.perf_counter()
    t0 = initial_temperature(wf, ham, cfg, dist) if start_step == 0 else float(_saved_t0(out))
    sector = build_sector(ham, cfg, dist)
    try:
        for step in range(start_step, cfg.steps):
            st = vmc_step(wf, ham, opt, cfg, step, dist, t0, sector)
            rec = asdict(st)
            rec["wall_time_s"] = time.perf_counter() - t_start
            if e_ref is not None:
                rec["error_mha"] = (st.energy - e_ref) * HARTREE_TO_MHA
            records.append(rec)
            if log_f is not None:
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
            if callback is not None:
                callback(st)
            done = step + 1
            if out is not None and dist.is_main and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                save_checkpoint(out, wf, opt, done, {"vmc": _jsonable(asdict(cfg)), "t0": t0})
    finally:
        if log_f is not None:
            log_f.close()
    final = evaluate_energy(wf, ham, cfg, dist)
    wall = time.perf_counter() - t_start
    if out is not None and dist.is_main and records:
        plot_convergence(out / "convergence.png", records, e_ref, title)
    return RunResult(wf, records, final, wall)


def _saved_t0(out: Path) -> float:
    return json.loads((out / "checkpoint" / "state.json").read_text()).get("t0", 0.0)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
