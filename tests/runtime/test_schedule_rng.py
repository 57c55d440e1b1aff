import math
import random

import numpy as np
import pytest
import torch

from seqlab.runtime import capture_rng, restore_rng, warmup_cosine


def test_warmup_then_cosine_reaches_the_floor_at_total():
    lr, total, warmup = 1e-3, 10, 3
    got = [warmup_cosine(s, total, lr, warmup, 0.1) for s in range(total + 2)]
    assert got[:3] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4])  # (step+1)/(warmup+1): no wasted first step
    assert got[3] == pytest.approx(lr)  # the peak, right after warmup
    assert got[total] == pytest.approx(0.1 * lr) and got[total + 1] == pytest.approx(0.1 * lr)  # clamped after
    mid = warmup + (total - warmup) / 2
    assert warmup_cosine(int(mid), total, lr, warmup, 0.1) > 0.1 * lr
    assert all(a >= b for a, b in zip(got[3:], got[4:]))  # monotone decay
    assert warmup_cosine(0, 4, lr, 0, 0.0) == pytest.approx(lr) and math.isfinite(warmup_cosine(5, 5, lr, 5, 0.0))


def test_rng_roundtrip_is_json_and_replays_every_generator():
    import json

    torch.randn(3), random.random(), np.random.rand()
    state = json.loads(json.dumps(capture_rng()))  # must survive JSON
    a = (torch.randn(5), random.random(), np.random.rand())
    restore_rng(state)
    b = (torch.randn(5), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
