"""CPU acceleration applied to a built model from outside: routes chosen by measurement on the running machine.

    from seqlab.accel import accelerate
    model = accelerate(model, for_="decode", rows=1)   # in place; returns the same model
    print(model.accel_plan.summary())                   # what was chosen, with the timings

The model stays plain math (``nn.Linear``); :func:`restore_plain` undoes the conversion. See docs/acceleration.md.
"""

from seqlab.accel.apply import AccelPlan, accelerate, plan_for
from seqlab.accel.restore import restore_plain
from seqlab.runtime.cpu import CpuSignature, current_signature, isa_above_avx2, native_bf16
from seqlab.accel.packed_linear import PackedLinear, is_packed, pack_for_inference, packing_available
from seqlab.accel.routes import Route, Use, builtin_routes
from seqlab.accel.train_linear import TrainLinear

__all__ = ["AccelPlan", "CpuSignature", "PackedLinear", "Route", "TrainLinear", "Use", "accelerate", "builtin_routes",
           "current_signature", "is_packed", "isa_above_avx2", "native_bf16", "pack_for_inference", "packing_available",
           "plan_for", "restore_plain"]
