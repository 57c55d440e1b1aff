"""Routes: the ways one linear product can run on this CPU, behind one small interface.

A route turns a plain ``nn.Linear`` into a module that computes the same product another way (packed weights,
another library, another dtype, quantised weights). :mod:`seqlab.accel.calibrate` times every available route on
each product shape of a model and keeps the fastest; ``dense`` (the layer unchanged, ``F.linear``) is the plain
route every other one must beat.

Adding a route (e.g. int8/int4 weights from :mod:`seqlab.quant`): implement :class:`Route` and pass an instance to
:func:`seqlab.accel.accelerate` via ``routes=``. ``convert`` must not change the layer it is given (calibration
converts throwaway layers; :func:`seqlab.accel.accelerate` replaces the model's layer with the result).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from seqlab.accel.packed_linear import PackedLinear, packing_available
from seqlab.accel.train_linear import TrainLinear, train_route_available

USES = ("decode", "prefill", "train")


@dataclass(frozen=True)
class Use:
    """What a product is for: ``decode``/``prefill`` (inference) or ``train``; ``rows`` activation rows per
    product; ``dtype`` the compute dtype of the weights (training: the autocast dtype over fp32 master weights)."""

    for_: str
    rows: int
    dtype: torch.dtype

    @property
    def inference(self) -> bool:
        return self.for_ != "train"


@runtime_checkable
class Route(Protocol):
    """One way to run ``y = x @ W.T + b``. ``name`` is what the cache and ``seqlab info`` show."""

    name: str

    def available(self, use: Use) -> bool:
        """Whether this route can run products for ``use`` on this machine and torch build."""
        ...

    def convert(self, layer: nn.Linear, use: Use) -> nn.Module:
        """A module computing ``layer``'s product this route's way (``layer`` itself for the plain route)."""
        ...


class DenseRoute:
    """The plain route: the layer unchanged (``F.linear``; MKL for fp32 on x86 CPUs)."""

    name = "dense"

    def available(self, use: Use) -> bool:
        return True

    def convert(self, layer: nn.Linear, use: Use) -> nn.Module:
        return layer


class PackedRoute:
    """Inference: the weight reordered once into oneDNN's blocked layout for ``use.rows``-row products."""

    name = "onednn-packed"

    def available(self, use: Use) -> bool:
        return use.inference and packing_available(use.dtype)

    def convert(self, layer: nn.Linear, use: Use) -> nn.Module:
        return PackedLinear(layer, rows_hint=use.rows)


class TrainRoute:
    """Training, fp32: the forward product on oneDNN; the input gradient too if ``igrad``, the weight gradient too
    if ``wgrad`` (only with ``igrad``). Why three: on an AVX2-only EPYC oneDNN ran every forward product of GPT-2
    small faster than MKL (the LM head's 1.6 against 2.2 s) and every gradient product slower."""

    def __init__(self, wgrad: bool, igrad: bool = True):
        if wgrad and not igrad:
            raise ValueError("TrainRoute: a weight gradient on oneDNN comes with the input gradient there")
        self.wgrad, self.igrad = wgrad, igrad
        self.name = "onednn-train-wgrad" if wgrad else "onednn-train" if igrad else "onednn-forward"

    def available(self, use: Use) -> bool:
        return use.for_ == "train" and use.dtype == torch.float32 and train_route_available()

    def convert(self, layer: nn.Linear, use: Use) -> nn.Module:
        return TrainLinear(layer, wgrad_onednn=self.wgrad, igrad_onednn=self.igrad)


def builtin_routes() -> list[Route]:
    """The routes seqlab ships, plain first."""
    return [DenseRoute(), PackedRoute(), TrainRoute(wgrad=False), TrainRoute(wgrad=True),
            TrainRoute(wgrad=False, igrad=False)]
