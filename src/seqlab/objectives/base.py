"""The contract between objectives and the trainer.

    class Objective(Protocol):
        name: str
        def collate(self, examples: list) -> dict[str, Tensor]   # padded tensors; labels use -100
        def num_targets(self, batch) -> int                      # valid targets (step-level normalisation)
        def loss(self, model, batch) -> ObjectiveOutput          # loss_sum, n_targets, metrics (, n_bytes)

Optional hooks with no-op defaults in :class:`BaseObjective`:

- ``setup(model)``: called once after the model is built/initialised and *before* a resume checkpoint is loaded
  (DPO snapshots its frozen reference policy here);
- ``state_dict()`` / ``load_state_dict(d)``: RNG position of objectives that draw randomness at collate time
  (MLM), saved with checkpoints so a resumed run masks exactly as the uninterrupted one;
- ``evaluating()``: a context manager to wrap an evaluation pass in; MLM then draws the *same* masks at every
  evaluation (comparable validation losses) without moving the training RNG;
- ``count_tokens(batch)``: positions the model processes (for tokens per second).

Class attributes tell the trainer and the CLI what they would otherwise learn from the objective's name:
``token_level`` (the loss is a mean NLL per target token, so perplexity and bits per byte mean something),
``loss_label`` (the y-axis of the loss curve), ``natural_text`` (trains on prose: BPE by default, trained on the
run's own text), ``can_pack`` (rows may hold several documents under a document mask) and ``uses_initial_model``
(``setup`` keeps the model it is given, DPO's frozen reference: ``seqlab eval`` must then rebuild the run's
initial model and pass that, or the loss would be measured against the trained weights themselves).

``check_options(options)`` (a classmethod) refuses out-of-range option values before the objective exists, so
the CLI can check ``--objective-arg`` before it writes anything; the constructors call it too.

Objectives call the model only through ``model(...)`` (its ``forward``), so DDP/FSDP wrappers see every pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import Tensor

from seqlab.objectives.loss import ObjectiveOutput


@runtime_checkable
class Objective(Protocol):
    name: str

    def collate(self, examples: list) -> dict[str, Tensor]: ...

    def num_targets(self, batch: dict[str, Tensor]) -> int: ...

    def loss(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> ObjectiveOutput: ...


class BaseObjective:
    name = "base"
    arch = "decoder"  # the ModelConfig.arch this objective trains
    token_level = True
    loss_label = "loss (nats / target token)"
    natural_text = False
    can_pack = False
    uses_initial_model = False
    default_seq_len = 128  # tokens per row when the run does not say (TrainConfig.seq_len)

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first option whose value is out of range (types are checked already,
        by ``objectives.check_objective_options``). ``options`` holds the constructor's keyword arguments."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        self._byte_table: Tensor | None = None

    @property
    def byte_table(self) -> Tensor | None:
        """Per-token UTF-8 byte lengths, for bits per byte (None if the tokenizer cannot say)."""
        if self._byte_table is None and hasattr(self.tokenizer, "byte_lengths"):
            self._byte_table = torch.tensor(self.tokenizer.byte_lengths(), dtype=torch.long)
        return self._byte_table

    def setup(self, model: torch.nn.Module) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        yield

    def at_batch(self, index: int) -> None:
        """Within :meth:`evaluating`: the next ``collate`` is batch ``index`` of the evaluation pass. An objective
        that draws per batch (MLM's masks) keys the draw by it, so ranks that each score a share of the batches
        mask each one as a single process does."""

    def count_tokens(self, batch: dict[str, Tensor]) -> int:
        """Real (unpadded) positions of every id tensor the model reads."""
        total = 0
        for key, mask_key in (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask")):
            ids = batch.get(key)
            if isinstance(ids, Tensor):
                mask = batch.get(mask_key)
                total += int(mask.sum()) if isinstance(mask, Tensor) else ids.numel()
        return total

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
