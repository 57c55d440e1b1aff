"""A training step's cross-entropy and its gradient in one C pass per row (``cross_entropy.c``), where that times faster.

Why: the logits are a step's largest tensor (2048 tokens x a 8192 vocabulary: 64 MiB in fp32), and the loss's torch
route passes over them five to six times: widen bf16 logits into fp32, softmax, gather, scatter the -1s, round the
gradient back to bf16, then scale it in the backward. The kernel reads each row from memory once and writes its
gradient once, in the logits' dtype, and the backward scales it in one more pass (ATen's bf16 ``mul_`` took three
times as long; timings: docs/acceleration.md, "Training's cross-entropy").

The math stays in :func:`seqlab.objectives.loss.token_cross_entropy` (the same softmax-minus-one-hot gradient, formed
in the forward pass); :func:`seqlab.accel.accelerate` puts a :class:`FusedCrossEntropy` on a model it accelerates
for training (``model.cross_entropy_kernel``), the objectives hand it to the loss, and
:func:`~seqlab.accel.restore_plain` takes it off. Differences from torch's route: exp to 2 ulp, and the loss as
logsumexp - logit (the same value to fp32 rounding).
"""
from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from seqlab.accel.calibrate import best_of_rounds, builds_per_dtype, describe_builds, dtype_name
from seqlab.objectives.loss import IGNORE_INDEX, release_scratch, token_cross_entropy
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("cross_entropy.c")
SIMD = Path(__file__).with_name("simd.h")
MAX_TIMED_ROWS = 512  # rows of the timed probe (rows are independent: its cost per row is the step's)
ROUNDS = 3
_BF16 = {torch.float32: 0, torch.bfloat16: 1}


def library(isa: str) -> ctypes.CDLL | None:
    return native.optional_library("cross_entropy", SOURCE, isa, [SIMD], _signatures,
                                   "seqlab.accel: cross-entropy kernel")


def _signatures(dll: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.seqlab_cross_entropy.argtypes = [p, i64, i32, p, i64, i64, i64, p, p, i32]
    dll.seqlab_cross_entropy.restype = ctypes.c_int
    dll.seqlab_scale_inplace.argtypes = [p, i32, i64, ctypes.c_float, i32]
    dll.seqlab_scale_inplace.restype = None


def available_isas() -> list[str]:
    return native.runnable_isas(library)


class FusedCrossEntropy:
    """Per-row losses and the summed CE's gradient of [N, V] logits in one call, on the build chosen for their
    dtype (``builds``: dtype -> "avx2" or "avx512"; logits of another dtype go to torch's route)."""

    def __init__(self, builds: dict[torch.dtype, str]):
        self.builds = dict(builds)

    def __call__(self, logits: Tensor, labels: Tensor, grad: Tensor) -> Tensor | None:
        """The [N] fp32 losses (0 on IGNORE_INDEX rows), with softmax - onehot written into ``grad`` (a dense
        [N, V] tensor of the logits' dtype); None, with ``grad`` untouched, where the kernel does not take these."""
        isa = self.builds.get(logits.dtype)
        if (isa is None or torch.compiler.is_compiling() or type(logits) is not Tensor or logits.dim() != 2
                or logits.device.type != "cpu" or logits.stride(1) != 1 or labels.shape != logits.shape[:1]
                or labels.dtype != torch.int64 or labels.device.type != "cpu" or grad.shape != logits.shape
                or grad.dtype != logits.dtype or not grad.is_contiguous()):
            return None
        labels = labels.contiguous()
        nll = torch.empty(logits.shape[0], dtype=torch.float32)
        rc = library(isa).seqlab_cross_entropy(
            logits.data_ptr(), logits.stride(0), _BF16[logits.dtype], labels.data_ptr(), logits.shape[0],
            logits.shape[1], IGNORE_INDEX, nll.data_ptr(), grad.data_ptr(), torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"cross-entropy: a target is outside [0, {logits.shape[1]}) and is not the ignore "
                             f"index {IGNORE_INDEX}")
        if rc != 0:
            raise RuntimeError("seqlab.accel: the cross-entropy kernel could not allocate its scratch")
        return nll

    def scale_(self, grad: Tensor, factor: Tensor) -> bool:
        """``grad.mul_(factor)`` for a gradient this kernel formed (the backward's pass over it), the same bits for
        every non-NaN value; False, with ``grad`` untouched, where it does not take these tensors, or where autograd
        should record the product (``create_graph`` with a factor that requires grad)."""
        isa = self.builds.get(grad.dtype)
        if (isa is None or torch.compiler.is_compiling() or type(grad) is not Tensor or grad.device.type != "cpu"
                or not grad.is_contiguous() or factor.numel() != 1 or factor.device.type != "cpu"
                or factor.dtype != torch.float32 or (factor.requires_grad and torch.is_grad_enabled())):
            return False
        library(isa).seqlab_scale_inplace(grad.data_ptr(), _BF16[grad.dtype], grad.numel(), float(factor),
                                          torch.get_num_threads())
        return True

    def __repr__(self) -> str:
        return describe_builds(self.builds)


def time_cross_entropy(rows: int, vocab: int, dtype: torch.dtype, candidates: dict[str, FusedCrossEntropy | None],
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per forward + backward of the summed CE on [rows, vocab] logits (a tenth of them ignored, as padding
    would be), through torch's route (a candidate None) and each kernel, best of interleaved rounds after a warm-up."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::10] = IGNORE_INDEX
    scale = torch.tensor(1.0 / rows)

    def run(kernel: FusedCrossEntropy | None) -> Callable[[], None]:
        def one() -> None:
            loss, _ = token_cross_entropy(logits, labels, kernel)
            loss.backward(scale)
            logits.grad = None
        return one

    best = best_of_rounds({name: run(kernel) for name, kernel in candidates.items()}, ROUNDS, clock)
    del logits
    release_scratch()  # the probe's [rows, vocab] buffers are not the step's
    return best


def choose_cross_entropy(model: nn.Module, rows: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
                         use_cache: bool = True) -> tuple[FusedCrossEntropy | None, dict[str, float]]:
    """The kernel builds for training ``model`` at ``rows`` tokens per step, per logits dtype in ``dtypes`` (None:
    torch's route is as fast for every one), and the timings ("<dtype> <candidate>": seconds per forward + backward;
    cached per CPU signature). A build must beat torch's route by ``calibrate.MIN_GAIN`` to be taken."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    isas = available_isas() if vocab else []
    if not isas:
        return None, {}
    rows = max(1, min(int(rows), MAX_TIMED_ROWS))
    loss_source = Path(sys.modules[token_cross_entropy.__module__].__file__)  # the math the kernel must match
    sources = native.source_key([SOURCE, SIMD, Path(__file__), loss_source])
    builds, timings = builds_per_dtype(
        dtypes, lambda dt: f"cross-entropy|{rows}x{vocab}|{dtype_name(dt)}|{'+'.join(isas)}|{sources}",
        lambda dt: {isa: FusedCrossEntropy({dt: isa}) for isa in isas},
        lambda dt, kernels: time_cross_entropy(rows, vocab, dt, {"torch": None, **kernels}), "torch", use_cache)
    return (FusedCrossEntropy(builds) if builds else None), timings
