"""Which examples each rank sees at each step: a seeded, resumable, world-size-independent order.

The global order is a fresh permutation per epoch (``torch.randperm`` from a generator seeded with
``(seed, epoch)``). Optimizer step ``s`` consumes the next ``global_batch = batch_size * grad_accum * world``
indices; rank ``r`` takes the r-th contiguous slice of that window and splits it into its micro-batches.

Two properties follow, and tests pin both:

- **Exact resume.** The position is two integers (epoch, step-in-epoch); nothing else is needed to continue.
- **Same data for any world size.** 1 process x 2 micro-batches and 2 processes x 1 micro-batch see the same
  global batch at every step, so DDP can be checked against a single process loss for loss.

A tail shorter than a global batch is skipped (different examples each epoch, since the order is reshuffled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerState:
    epoch: int = 0
    step_in_epoch: int = 0


class StepSampler:
    def __init__(self, n_examples: int, batch_size: int, grad_accum: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True):
        self.n, self.batch_size, self.grad_accum = n_examples, batch_size, grad_accum
        self.rank, self.world, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.global_batch = batch_size * grad_accum * world_size
        if n_examples < self.global_batch:
            raise ValueError(
                f"the training set has {n_examples} examples but one optimizer step needs "
                f"batch_size*grad_accum*world_size = {batch_size}*{grad_accum}*{world_size} = {self.global_batch}; "
                "use a smaller batch or more data"
            )
        self.steps_per_epoch = n_examples // self.global_batch
        self.state = SamplerState()
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n, generator=g)
            else:
                self._perm = torch.arange(self.n)
            self._perm_epoch = epoch
        return self._perm

    def next_step(self) -> list[list[int]]:
        """Indices of this rank's micro-batches for the next optimizer step (advances the position)."""
        st = self.state
        if st.step_in_epoch >= self.steps_per_epoch:
            st.epoch, st.step_in_epoch = st.epoch + 1, 0
        order = self._order(st.epoch)
        start = st.step_in_epoch * self.global_batch + self.rank * self.batch_size * self.grad_accum
        mine = order[start: start + self.batch_size * self.grad_accum].tolist()
        st.step_in_epoch += 1
        return [mine[i * self.batch_size:(i + 1) * self.batch_size] for i in range(self.grad_accum)]

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "step_in_epoch": self.state.step_in_epoch, "n_examples": self.n,
                "global_batch": self.global_batch}

    def load_state_dict(self, d: dict) -> None:
        if d.get("n_examples") != self.n:
            raise ValueError(f"cannot resume the data position: the checkpoint was taken with {d.get('n_examples')} "
                             f"examples, this run has {self.n}")
        old = d.get("global_batch")
        if old != self.global_batch:
            per_accum = self.batch_size * self.world
            keeps = (f"; --grad-accum {old // per_accum} keeps it with {self.world} "
                     f"process{'es' if self.world > 1 else ''}"
                     if isinstance(old, int) and old % per_accum == 0 else "")
            raise ValueError(
                f"cannot resume the data position: the checkpoint's global batch (batch_size x grad_accum x "
                f"processes) is {old}, this run's {self.batch_size} x {self.grad_accum} x {self.world} = "
                f"{self.global_batch}{keeps}")
        self.state = SamplerState(int(d["epoch"]), int(d["step_in_epoch"]))
