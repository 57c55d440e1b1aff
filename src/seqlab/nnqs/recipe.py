"""The optimiser settings that go with each start: a warm start (the default) or a random start with annealing.

The two starts need different optimisers, which is why these are not single defaults in ``VMCConfig``:

- **Random start** (``--warm-start none``): entropy annealing keeps P broad while the phase MLP, at 10x the
  learning rate, learns the sign structure before P concentrates near Hartree-Fock (docs/nnqs.md, "Training
  recipe"). Adam's beta2 0.99 follows the fast-changing gradients of the annealing phase.
- **Warm start** (CISD or HF fitted first): the signs and the largest amplitudes are already right, so there is no
  annealing, and the phase learns at the amplitudes' rate. Adam moves every parameter by about the learning rate
  per step whatever its gradient, which a state fitted to 1e-4 infidelity cannot take at 5e-3 (measured on N2:
  lr 1e-2 collapsed onto HF within 10 steps even with exact gradients; 1e-3 and 2e-3 descended, 2e-3 faster). A
  long warmup (40 steps) and beta2 0.999 let Adam's second moments settle before the full rate is reached, and the
  cosine ends at 2 % of it, where the last mHa are gained without the oscillation of a constant rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    lr: float
    warmup: int
    anneal: float
    phase_lr_scale: float
    beta2: float
    min_lr_ratio: float


RANDOM_START = Recipe(lr=5e-3, warmup=20, anneal=0.07, phase_lr_scale=10.0, beta2=0.99, min_lr_ratio=0.05)
WARM_START = Recipe(lr=2e-3, warmup=40, anneal=0.0, phase_lr_scale=1.0, beta2=0.999, min_lr_ratio=0.02)


def recipe_for(warm_start: str) -> Recipe:
    """The recipe for a ``--warm-start`` method ("none" is the random start)."""
    return RANDOM_START if warm_start == "none" else WARM_START
