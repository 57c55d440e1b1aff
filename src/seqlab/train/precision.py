"""Mixed precision: which autocast dtype to use, and a GradScaler only where fp16 needs one.

``auto`` picks what is *fast* on the device, not what is fashionable: bf16 autocast on GPUs that support it,
fp16 + dynamic loss scaling on older GPUs, and on CPU bf16 only when the CPU has native bf16 matmuls (AMX or
AVX512-BF16). On an AVX2-only CPU oneDNN emulates bf16 and a matmul is far *slower* than fp32 (docs/training.md
has the measurement), so auto stays in fp32 there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from seqlab.runtime.cpu import native_bf16
from seqlab.train.config import PRECISIONS


@dataclass
class Precision:
    name: str  # fp32 | bf16 | fp16
    device_type: str

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> "torch.amp.GradScaler | None":
        if self.name == "fp16":
            return torch.amp.GradScaler(self.device_type)
        return None


def resolve_precision(name: str, device: torch.device, field: str = "TrainConfig.precision") -> Precision:
    """``name`` (one of ``PRECISIONS``) on ``device``; ``field`` is what a refusal names (``--precision`` for eval)."""
    if name not in PRECISIONS:
        raise ValueError(f"{field}: unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        elif device.type == "cpu":
            name = "bf16" if native_bf16() else "fp32"  # native only: ISA caps that hide it count
        else:
            name = "fp32"
    if name == "fp16" and device.type == "cpu":
        raise ValueError(f"{field}: fp16 needs a GPU (use bf16 or fp32 on CPU)")
    return Precision(name, device.type)
