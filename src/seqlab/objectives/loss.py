"""Token-normalised cross-entropy, and the output every objective returns.

Why a *sum* and a *count* instead of a mean: the loss of one optimizer step must be

    (sum of token losses over all micro-batches and ranks) / (number of valid targets in all of them)

Averaging per-micro-batch means instead weights a token in a short (heavily padded) micro-batch more than a token
in a long one: that is the gradient-accumulation bug that hit a major trainer in 2024. So objectives return
``loss_sum`` and ``n_targets``; the trainer first counts the step's targets (``objective.num_targets(batch)`` for
every micro-batch, all-reduced over ranks), then backpropagates ``loss_sum * world_size / step_targets`` per
micro-batch (DDP averages gradients over ranks, hence the ``world_size``). The result equals one big batch exactly
(tests/objectives/test_accumulation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from seqlab.data.collate import IGNORE_INDEX
from seqlab.runtime.memory import ScratchPool

__all__ = ["IGNORE_INDEX", "ObjectiveOutput", "token_cross_entropy", "sequence_logprobs", "count_bytes",
           "cross_entropy_kernel", "release_scratch"]


class RowCrossEntropy(Protocol):
    """A CE kernel installed from outside (``seqlab.accel.cross_entropy``) for :func:`token_cross_entropy`. It may
    also have ``scale_(grad, factor) -> bool``: ``grad.mul_(factor)`` on a gradient it formed (the backward's pass),
    False where it does not take the tensors; without one the backward runs ``mul_``."""

    def __call__(self, logits: Tensor, labels: Tensor, grad: Tensor) -> Tensor | None:
        """(logits [N, V], labels [N], grad [N, V] to fill with softmax - onehot) -> the [N] fp32 row losses, or
        None where it does not take these tensors."""


@dataclass
class ObjectiveOutput:
    """``loss_sum``: scalar tensor, summed over this batch's ``n_targets`` valid targets (nats for token losses,
    summed per-pair losses for DPO). ``metrics``: floats *averaged over this batch*; to combine batches weight
    each by its entry in ``metric_weights`` (a per-sequence metric: the rows), else by ``n_targets``. ``n_bytes``:
    UTF-8 bytes the scored targets stand for, when meaningful (bits per byte)."""

    loss_sum: Tensor
    n_targets: int
    metrics: dict[str, float] = field(default_factory=dict)
    n_bytes: int | None = None
    metric_weights: dict[str, int] = field(default_factory=dict)

    def weight(self, name: str) -> int:
        """What ``metrics[name]`` is a mean over in this batch."""
        return self.metric_weights.get(name, self.n_targets)

    @property
    def loss(self) -> Tensor:
        """Mean over this batch only: for logging and single-batch use, never for accumulation."""
        return self.loss_sum / max(self.n_targets, 1)


def cross_entropy_kernel(model: torch.nn.Module) -> RowCrossEntropy | None:
    """The CE kernel put on ``model`` from outside (``seqlab.accel``), if any; a DDP/FSDP wrapper's inner model
    is looked at too."""
    return getattr(getattr(model, "module", model), "cross_entropy_kernel", None)


def token_cross_entropy(logits: Tensor, labels: Tensor, kernel: RowCrossEntropy | None = None
                        ) -> tuple[Tensor, int]:
    """Sum of -log p(label) over positions whose label is not IGNORE_INDEX, and how many there are.

    ``logits`` [..., V] and ``labels`` [...] are already aligned (no shift here). Only the valid rows are gathered
    before the softmax, so padded or prompt positions cost no softmax work; the softmax runs in fp32 whatever the
    model dtype, because bf16 log-probabilities lose ~3 significant digits. ``kernel`` (see
    :func:`cross_entropy_kernel`) computes the fused gradient's softmax where it takes the tensors.
    """
    valid = labels != IGNORE_INDEX
    n = int(valid.sum())
    if n == 0:
        return logits.sum() * 0.0, 0  # keeps the graph connected (DDP needs every parameter to get a grad)
    if 2 * n >= valid.numel():
        # mostly valid (pretraining): one CE over the whole tensor; a boolean gather would copy the logits
        # forward and scatter them back in the backward pass
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if flat.requires_grad and torch.is_grad_enabled() and flat.dtype in (torch.float32, torch.bfloat16):
            return _CrossEntropySum.apply(flat, flat_labels, kernel), n
        return F.cross_entropy(flat.float(), flat_labels, ignore_index=IGNORE_INDEX, reduction="sum"), n
    picked = logits[valid].float()
    return F.cross_entropy(picked, labels[valid], reduction="sum"), n


_TINY_PROB = 1e-30
# The [N, V] softmax and gradient of the fused CE, the largest tensors of a training step, reused from one step to
# the next while free (``runtime.memory.ScratchPool``: a fresh one costs its page faults every step).
_SCRATCH = ScratchPool()


def release_scratch() -> None:
    """Let go of the pooled [N, V] buffers (after a probe at another shape: they would stay until replaced)."""
    _SCRATCH.clear()


def _pooled(logits: Tensor) -> bool:
    """Eager CPU work takes its [N, V] tensors from the pool; a traced graph or CUDA's caching allocator plans its
    own buffers."""
    return logits.device.type == "cpu" and not torch.compiler.is_compiling()


def _softmax_fp32(logits: Tensor) -> Tensor:
    """softmax(logits) in fp32, in a pooled tensor: fp32 logits go straight in; bf16 ones are widened into it first
    (``torch.softmax(dtype=float32)`` on the CPU would make that fp32 copy and a second tensor for the result)."""
    if not _pooled(logits):
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    out = _SCRATCH.take(logits.shape, torch.float32)
    if logits.dtype == torch.float32:
        return torch.ops.aten._softmax.out(logits, -1, False, out=out)
    out.copy_(logits)
    return torch.ops.aten._softmax.out(out, -1, False, out=out)  # in place: elementwise per row, alias-safe


class _CrossEntropySum(torch.autograd.Function):
    """Summed CE over rows whose label is not IGNORE_INDEX, with its gradient formed during the forward pass.

    Why: ``F.cross_entropy`` saves the log-probabilities, then the backward pass reads them again, writes a zeroed
    [N, V] tensor for the one-hot and combines them: about four passes over the logits. The gradient of a summed
    CE is simply ``softmax - onehot`` (zero on ignored rows); computing it while the logits are in hand and saving
    it instead of the log-probabilities (same memory) leaves one softmax pass forward and one scaling pass
    backward (docs/training.md has the timing). bf16 logits (autocast) are read as they are: the softmax runs in
    fp32 inside its kernel, and the saved gradient is rounded to bf16 once, which is what autocast's cast back to
    the bf16 head would do to an fp32 gradient anyway (without the fp32 copy of the logits and its backward).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, kernel: RowCrossEntropy | None = None) -> Tensor:
        if kernel is not None and _pooled(logits):
            grad = _SCRATCH.take(logits.shape, logits.dtype)
            nll = kernel(logits, labels, grad)
            if nll is not None:  # the same gradient, formed in one pass per row
                ctx.save_for_backward(grad)
                ctx.used, ctx.kernel = False, kernel
                return nll.sum()
            del grad
        valid = labels != IGNORE_INDEX
        safe = labels.masked_fill(~valid, 0).unsqueeze(1)
        grad = _softmax_fp32(logits)
        p = grad.gather(1, safe).squeeze(1)
        # -log p is exact to fp32 rounding while p is a normal number; rows whose p underflows (a target more than
        # ~69 nats below the best logit) take log_softmax's exact value instead
        tiny = p < _TINY_PROB
        nll = -torch.log(p)
        if bool(tiny.any()):
            rows = tiny.nonzero().squeeze(1)
            nll[rows] = -torch.log_softmax(logits[rows].float(), dim=-1).gather(1, safe[rows]).squeeze(1)
        loss = (nll * valid).sum()
        grad.scatter_add_(1, safe, valid.to(grad.dtype).neg_().unsqueeze(1))  # - onehot (nothing on ignored rows)
        ignored = (~valid).nonzero().squeeze(1)
        if ignored.numel():
            grad.index_fill_(0, ignored, 0.0)  # touches the ignored rows only
        if logits.dtype != grad.dtype:
            grad = _SCRATCH.take(grad.shape, logits.dtype).copy_(grad) if _pooled(logits) else grad.to(logits.dtype)
        ctx.save_for_backward(grad)
        ctx.used, ctx.kernel = False, None
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        # scaled in place: a fresh [N, V] tensor per step costs an allocation and page faults, and the saved
        # gradient is needed exactly once (a second backward through the same graph is refused, not miscomputed)
        if ctx.used:
            raise RuntimeError("token_cross_entropy's fused gradient supports one backward pass per forward "
                               "(retain_graph=True with a second backward is not supported)")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        scale = getattr(ctx.kernel, "scale_", None)  # a kernel that forms the gradient may scale it too
        if scale is None or not scale(grad, grad_out):
            grad.mul_(grad_out)
        return grad, None, None


def sequence_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-row sum of log p(label) over valid positions ([B, T, V], [B, T] aligned) -> [B] (fp32)."""
    valid = labels != IGNORE_INDEX
    safe = labels.masked_fill(~valid, 0)
    lp = -F.cross_entropy(logits.float().transpose(1, 2), safe, reduction="none")  # [B, T]
    return (lp * valid).sum(-1)


def count_bytes(labels: Tensor, byte_table: Tensor | None) -> int | None:
    """UTF-8 bytes of the valid targets, from a per-token byte-length table (None if no table)."""
    if byte_table is None:
        return None
    valid = labels != IGNORE_INDEX
    return int(byte_table.to(labels.device)[labels[valid]].sum())
