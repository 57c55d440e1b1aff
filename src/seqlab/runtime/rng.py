"""This process's random-number state as JSON, so a resumed run draws the same numbers as an unbroken one.

Covers torch (CPU and, once initialised, CUDA), Python's ``random`` and NumPy's global generator if NumPy is
loaded. Byte states travel as base64 strings: no pickles, and the result fits in a checkpoint's state.json.
"""

from __future__ import annotations

import base64
import random
import sys
from typing import Any

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.tolist())).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """The current RNG states as JSON-able data."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")  # only if something already imported it: never import NumPy for this
    if np is not None:
        name, keys, pos, has_gauss, gauss_np = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss_np)]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (CUDA and NumPy parts only where present here too)."""
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss_np = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss_np))
