"""The whole-pass check: routes that win per shape but lose over the model's products in order are dropped."""
from collections import Counter

import pytest
import torch
from torch import nn

from seqlab.accel import PackedLinear, accelerate
from seqlab.accel import apply as accel_apply
from seqlab.accel import calibrate
from seqlab.accel.routes import Use, builtin_routes
from seqlab.accel.verify import time_pass
from seqlab.runtime.cpu import current_signature

from .helpers import SleepyPacked, tiny_model


class Trap(SleepyPacked):
    """Fast on paper (the seeded cache says so), 5 ms per product in the whole pass."""

    name = "trap"
    sleep_s = 0.005


def _seed_cache_in_favour_of(route: str, model: nn.Module, use: Use) -> None:
    """Per-shape timings that make ``route`` the clear winner on every shape of ``model``."""
    shapes = Counter((m.in_features, m.out_features, m.bias is not None) for m in model.modules()
                     if type(m) is nn.Linear)
    extra = [] if route in {r.name for r in builtin_routes()} else [route]  # a caller's route: its own entries
    calibrate.store_cache(current_signature(), {calibrate.shape_key(use, *s, extra_routes=extra):
                                                {"dense": 1.0, route: 0.1} for s in shapes})


def test_routes_that_lose_the_whole_pass_are_dropped_and_the_verdict_is_cached():
    model, plain = tiny_model(), tiny_model()
    _seed_cache_in_favour_of("trap", model, Use("decode", 1, torch.float32))
    Trap.converted = 0
    accelerate(model, "decode", rows=1, dtype="fp32", routes=[Trap()], fused=False)
    plan = model.accel_plan
    assert Trap.converted > 0  # the per-shape plan took it ...
    assert all(c.route == "trap" for c in plan.shapes["fp32"])
    assert not plan.kept and plan.pass_s["plan"] > plan.pass_s["dense"]  # ... and the pass threw it out
    assert all(type(m) is not PackedLinear for m in model.modules())
    assert "routes dropped" in plan.summary()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids))  # restored exactly: the dense weights came back
    Trap.converted = 0
    accelerate(model, "decode", rows=1, dtype="fp32", routes=[Trap()], fused=False)
    assert Trap.converted == 0 and not model.accel_plan.kept  # the cached verdict: not even converted again


def test_without_the_check_the_per_shape_plan_is_applied():
    model = tiny_model()
    _seed_cache_in_favour_of("trap", model, Use("decode", 1, torch.float32))
    accelerate(model, "decode", rows=1, dtype="fp32", routes=[Trap()], verify=False, fused=False)
    assert model.accel_plan.kept and not model.accel_plan.pass_s
    assert any(type(m) is PackedLinear for m in model.modules())


def test_a_cached_winning_pass_keeps_the_routes_without_timing(monkeypatch):
    model = tiny_model()
    use = Use("decode", 1, torch.float32)
    _seed_cache_in_favour_of("onednn-packed", model, use)
    first = accelerate(tiny_model(), "decode", rows=1, dtype="fp32", fused=False).accel_plan  # writes the pass verdict
    key = next(k for k in calibrate.load_cache(current_signature()) if k.startswith("pass|"))
    path = calibrate.cache_path(current_signature())
    path.write_text(path.read_text().replace(str(first.pass_s["plan"]), "1e-09"))  # the routes won, say
    monkeypatch.setattr(accel_apply, "time_pass", lambda *a, **k: pytest.fail("timed although cached"))
    accelerate(model, "decode", rows=1, dtype="fp32", fused=False)
    assert model.accel_plan.kept and model.accel_plan.pass_s["plan"] == 1e-09
    assert any(type(m) is PackedLinear for m in model.modules())
    assert key.startswith("pass|decode|float32|rows=1|")


def test_time_pass_runs_every_layer_and_takes_the_fastest_round():
    calls = Counter()

    class Probe(nn.Linear):
        def forward(self, x):
            calls[self.out_features] += 1
            return super().forward(x)

    layers = [Probe(8, 4), Probe(4, 3)]
    ticks = iter(range(1000))
    seconds = time_pass(layers, Use("decode", 2, torch.float32), budget_s=0.0, clock=lambda: next(ticks))
    assert seconds == 1  # every pass reads the fake clock twice, one tick apart
    assert calls[4] == calls[3] == 1 + 3  # the warm-up pass and MIN_ROUNDS timed ones
