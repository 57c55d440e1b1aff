"""accelerate(): same numbers as the plain model (per-dtype tolerances), choices by measurement, cache per CPU."""
import copy
import dataclasses
import json
import time

import pytest
import torch
from torch import nn

from seqlab.accel import PackedLinear, TrainLinear, accelerate, plan_for, restore_plain
from seqlab.accel import apply as accel_apply
from seqlab.accel import calibrate
from seqlab.runtime.cpu import current_signature, native_bf16
from seqlab.accel.routes import DenseRoute, PackedRoute, Use
from seqlab.cli import build_parser, main
from seqlab.generate import generate
from seqlab.io import save_pretrained
from seqlab.quant import quantize

from .helpers import SleepyPacked, tiny_model

# fp32 routes change only the summation order: logits (|x| ~ 1) agree to ~1e-6; 1e-5 leaves room for any ISA
FP32_ATOL = 1e-5
# bf16 weights and products keep 8 significant bits: logits of this tiny model move by up to ~1e-2
BF16_ATOL = 5e-2


class SlowPacked(SleepyPacked):
    """A sleep of 50 ms per product, far above a 64-wide product's time even on a busy machine: never chosen."""

    name = "slow-packed"


def _ids(batch=3, length=9):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("for_,rows", [("decode", 1), ("decode", 3), ("prefill", None)])
def test_accelerated_fp32_logits_equal_the_plain_model(for_, rows):
    plain, model = tiny_model(tie=False, bias=True), tiny_model(tie=False, bias=True)
    # fused=False: the per-product routes themselves (tests/accel/test_fused_step.py covers the fused decode step)
    assert accelerate(model, for_, rows=rows, dtype="fp32", budget_s=0.5, fused=False) is model  # in place, same object
    assert model.accel_plan.dtype == "fp32"
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), atol=FP32_ATOL, rtol=FP32_ATOL)


@pytest.mark.skipif(not native_bf16(), reason="bf16 is only chosen where the CPU has native bf16")
def test_accelerated_bf16_logits_are_close_to_fp32():
    plain, model = tiny_model(), tiny_model()
    accelerate(model, "prefill", dtype="bf16", budget_s=0.5)
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).float(), plain(ids), atol=BF16_ATOL, rtol=0)


def test_a_quantised_model_keeps_fp32_where_no_dense_product_was_timed(monkeypatch):
    """A model quantised throughout has no dense product to time: both dtype totals are 0, and 0 <= 0 once took
    bf16 unmeasured (batched decode on a bf16 CPU), which cast the quantised layers' scales. Nothing says bf16 is
    faster, so the plan stays fp32 and the logits stay the model's."""
    monkeypatch.setattr(accel_apply, "native_bf16", lambda: True)  # as on an AMX machine, whatever this one is
    model = quantize(tiny_model(), bits=4, group_size=32)
    ids = _ids()
    with torch.no_grad():
        before = model(ids)
    plan = plan_for(model, "decode", rows=2, dtype="auto", budget_s=0.2)
    assert set(plan.dtype_totals_s) == {"fp32", "bf16"} and plan.dtype == "fp32"
    accelerate(model, "decode", rows=2, dtype="auto", budget_s=0.2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before, rtol=0, atol=1e-5)


def test_training_routes_give_the_plain_gradients():
    plain, model = tiny_model(tie=False, bias=True), tiny_model(tie=False, bias=True)
    params_before = list(model.parameters())
    accelerate(model, "train", rows=27, dtype="fp32", budget_s=0.5)
    assert list(model.parameters()) == params_before  # the same Parameter objects: an optimizer keeps working
    # whatever the calibration picked, the oneDNN training route must also be checked: force it on every layer
    forced = tiny_model(tie=False, bias=True)
    for name, m in list(forced.named_modules()):
        if type(m) is nn.Linear:
            parent, _, child = name.rpartition(".")
            setattr(forced.get_submodule(parent), child, TrainLinear(m, wgrad_onednn=child == "proj"))
    ids = _ids()
    for net in (plain, model, forced):
        net.train()
        net(ids).logsumexp(-1).sum().backward()
    for (name, p), q, r in zip(plain.named_parameters(), model.parameters(), forced.parameters()):
        # gradients: the same sums in another order, before any optimizer amplifies the rounding
        torch.testing.assert_close(q.grad, p.grad, atol=FP32_ATOL, rtol=FP32_ATOL, msg=name)
        torch.testing.assert_close(r.grad, p.grad, atol=FP32_ATOL, rtol=FP32_ATOL, msg=name)


def test_a_route_made_slow_is_not_chosen():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no waiting on a descheduled sibling thread inside a timed product
    try:
        _check_slow_route_refused()
    finally:
        torch.set_num_threads(threads)


def _check_slow_route_refused():
    model = tiny_model()
    plan = plan_for(model, "decode", rows=1, dtype="fp32", routes=[SlowPacked()], budget_s=0.5)
    assert SlowPacked.converted > 0  # it was tried (and then timed, or dropped as hopeless after its first call)
    for choice in plan.shapes["fp32"]:
        assert choice.timings_s.get("slow-packed", float("inf")) > choice.timings_s["dense"]
        assert choice.route != "slow-packed"


class TickRoute(DenseRoute):
    """The plain product on a fake clock: every call costs 1 tick, except the calls listed in ``stalls``."""

    def __init__(self, name: str, clock: list[float], stalls: dict[int, float]):
        self.name, self.clock, self.stalls = name, clock, stalls

    def convert(self, layer, use):
        return _TickLinear(layer, self.clock, self.stalls)


class _TickLinear(nn.Module):
    def __init__(self, layer: nn.Linear, clock: list[float], stalls: dict[int, float]):
        super().__init__()
        self.layer, self.clock, self.stalls, self.calls = layer, clock, stalls, 0

    def forward(self, x):
        self.calls += 1
        self.clock[0] += self.stalls.get(self.calls, 1.0)
        return self.layer(x)


def test_a_spent_budget_still_gets_a_timed_round():
    """When the warm-up alone exceeds the budget (a large LM head), the routes still get an interleaved round, so
    one stalled call (here the warm-up's timed call, 10 ticks instead of 1) does not decide the choice."""
    now = [0.0]
    routes = [TickRoute("plain", now, {}), TickRoute("stalled", now, {2: 10.0})]
    timings = calibrate.time_routes(Use("decode", 1, torch.float32), 8, 8, False, routes, budget_s=0.0,
                                    clock=lambda: now[0])
    assert timings == {"plain": 1.0, "stalled": 1.0}


def test_best_of_rounds_skips_the_warm_up_and_keeps_each_candidates_fastest_round():
    """The probes' shared timing loop: the warm-up round is no sample (a quick one included), rounds interleave the candidates, the best
    round counts, a declined call gives no sample, and ``setup`` runs outside the timed span."""
    now = [0.0]
    ticks = {"a": iter([0.5, 5.0, 3.0, 4.0]), "b": iter([100.0, 2.0, 7.0, 2.5]), "c": iter([0.1, 0.1, 9.0, 0.1])}
    order, setups = [], []

    def run(name):
        def one(arg):
            assert arg == f"made for {name}" and setups[-1] == name
            order.append(name)
            tick = next(ticks[name])
            now[0] += tick
            return None if name == "c" and tick < 1 else name  # c declines its quick calls (a fallback)
        return one

    def setup(name):
        setups.append(name)
        now[0] += 1000.0  # outside the timed span
        return f"made for {name}"

    timings = calibrate.best_of_rounds({k: run(k) for k in ticks}, 3, clock=lambda: now[0], setup=setup,
                                       declined=lambda out: out is None)
    assert order == ["a", "b", "c"] * 4
    assert timings == {"a": 3.0, "b": 2.0, "c": 9.0}
    assert calibrate.best_of_rounds({"x": lambda: None}, 0) == {"x": float("inf")}  # no round: no sample
    # warm_up=False (the same calls ran at another size): every call is a sample, the first one included
    ticks = iter([0.5, 5.0, 3.0])
    calls = []

    def timed():
        calls.append(1)
        now[0] += next(ticks)

    assert calibrate.best_of_rounds({"a": timed}, 3, clock=lambda: now[0], warm_up=False) == {"a": 0.5}
    assert len(calls) == 3


def test_a_route_faster_than_plain_is_chosen_and_slower_never():
    timings = {"dense": 2.0, "a": 1.0, "b": 3.0}
    assert calibrate.fastest(timings) == "a"
    assert calibrate.fastest({"dense": 1.0, "b": 1.0}) == "dense"  # a tie keeps the plain route
    assert calibrate.fastest({"dense": 1.0, "b": 0.99}) == "dense"  # and so does a gain within timing noise


def test_cache_is_reused_and_invalidated_by_cpu_or_torch(monkeypatch):
    model = tiny_model()
    first = plan_for(model, "decode", rows=2, dtype="fp32", budget_s=0.3)
    assert first.calibration_s > 0
    again = plan_for(model, "decode", rows=2, dtype="fp32", budget_s=0.3)
    assert again.calibration_s == 0.0  # every shape came from the cache
    assert [c.timings_s for c in again.shapes["fp32"]] == [c.timings_s for c in first.shapes["fp32"]]
    real = current_signature()
    for change in ({"cpu_model": "Another CPU"}, {"torch_version": "9.9.9"}, {"flags": ("avx2",)}):
        other = dataclasses.replace(real, **change)
        assert other.key() != real.key()
        monkeypatch.setattr(accel_apply, "current_signature", lambda other=other: other)
        assert calibrate.load_cache(other) == {}
        assert plan_for(model, "decode", rows=2, dtype="fp32", budget_s=0.3).calibration_s > 0
    # a file whose stored signature disagrees with its name is ignored too
    path = calibrate.cache_path(real)
    doc = path.read_text().replace(real.torch_version, "0.0.0")
    path.write_text(doc)
    assert calibrate.load_cache(real) == {}


def test_the_calibration_time_counts_every_step_that_measured_and_nothing_read_from_the_cache(monkeypatch):
    def measure():
        time.sleep(0.2)
        return {"a": 1.0}

    with calibrate.measuring_time() as seconds:
        calibrate.cached_timings("probe", measure)
        assert seconds[0] >= 0.2
        before = seconds[0]
        assert calibrate.cached_timings("probe", measure) == {"a": 1.0}  # from the cache: no time counted
        assert seconds[0] == before
    choose_fused = accel_apply.choose_fused

    def slow_step_check(*args, **kwargs):  # a step after the products' timing that measures for 0.2 s
        calibrate.cached_timings("slow step", measure)
        return choose_fused(*args, **kwargs)

    products = []  # plan_for's own figure: the products' timing alone
    plan_for = accel_apply.plan_for

    def recorded_plan_for(*args, **kwargs):
        plan = plan_for(*args, **kwargs)
        products.append(plan.calibration_s)  # (accelerate later puts the total on the same plan)
        return plan

    monkeypatch.setattr(accel_apply, "choose_fused", slow_step_check)
    monkeypatch.setattr(accel_apply, "plan_for", recorded_plan_for)
    model = tiny_model()
    t0 = time.perf_counter()
    accelerate(model, "decode", rows=1, dtype="fp32", budget_s=0.3)
    wall = time.perf_counter() - t0
    plan = model.accel_plan
    assert products[0] + 0.2 <= plan.calibration_s <= wall  # every step's timing, none counted twice
    assert f"calibrated in {plan.calibration_s:.1f} s" in plan.summary()
    assert plan.cache_file and plan.cache_file in plan.summary()
    accelerate(model, "decode", rows=1, dtype="fp32", budget_s=0.3)
    assert model.accel_plan.calibration_s == 0.0
    assert f"timings from {plan.cache_file}" in model.accel_plan.summary()


def test_a_hand_edited_cache_is_measured_again_not_trusted(capsys):
    """Entries that are not timings (a string, a negative or NaN time) or lack what a choice needs (an emptied step
    entry) once crashed every command or won their choice: they are said once, measured again and written back."""
    model = tiny_model()
    accelerate(model, "decode", rows=1, dtype="fp32", budget_s=0.3)
    path = calibrate.cache_path(current_signature())
    doc = json.loads(path.read_text())
    entries = doc["entries"]
    product = next(k for k in entries if k.startswith("decode|fp32|rows=1|"))
    steps = [k for k in entries if k.startswith("step|")]
    entries[product] = {**entries[product], "dense": "fast", "onednn-packed": -1.0}
    for k in steps:
        entries[k] = {}
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    again = accelerate(tiny_model(), "decode", rows=1, dtype="fp32", budget_s=0.3)
    assert "of its entries are not timings" in capsys.readouterr().err
    assert again.accel_plan.calibration_s > 0
    fixed = json.loads(path.read_text())["entries"]
    assert all(isinstance(v, float) and v > 0 for v in fixed[product].values())
    assert all(fixed[k] for k in steps)  # the fused-step check timed again, where a fused step exists
    capsys.readouterr()
    calibrate._WARNED.clear()
    doc = json.loads(path.read_text())
    doc["entries"][product] = {**doc["entries"][product], "onednn-packed": float("inf")}  # every call declined
    path.write_text(json.dumps(doc))
    assert calibrate.load_cache(current_signature())[product]["onednn-packed"] == float("inf")
    assert capsys.readouterr().err == ""  # a timing like any other, not a malformed entry


def test_a_callers_own_route_keeps_its_own_cache_entries():
    """Timings taken with a route a caller added stay that caller's: a later accelerate() without it neither
    chooses it nor stumbles on it (a KeyError once), and takes the plain entries."""
    model = tiny_model()
    accelerate(model, "decode", rows=1, dtype="fp32", budget_s=0.3, fused=False,
               routes=[type("Always", (PackedRoute,), {"name": "always"})()])
    plain = accelerate(tiny_model(), "decode", rows=1, dtype="fp32", budget_s=0.3, fused=False)
    assert all(c.route != "always" and "always" not in c.timings_s for c in plain.accel_plan.shapes["fp32"])
    entries = calibrate.load_cache(current_signature())
    assert any("routes=always" in k for k in entries) and any(
        k.startswith("decode|") and "routes=" not in k for k in entries)


def test_a_cached_route_this_process_lacks_is_not_chosen():
    """An entry naming a route seqlab does not have here (a newer seqlab sharing the cache, a hand edit) won its
    choice and crashed accelerate() with a KeyError."""
    accelerate(tiny_model(), "decode", rows=1, dtype="fp32", budget_s=0.3, fused=False)
    path = calibrate.cache_path(current_signature())
    doc = json.loads(path.read_text())
    for k, v in doc["entries"].items():
        if k.startswith("decode|"):
            v["future-route"] = min(v.values()) / 10
    path.write_text(json.dumps(doc))
    again = accelerate(tiny_model(), "decode", rows=1, dtype="fp32", budget_s=0.3, fused=False, verify=False)
    assert all(c.route != "future-route" for c in again.accel_plan.shapes["fp32"])


def test_restore_plain_gives_back_the_dtype_and_what_trained(monkeypatch):
    """After a bf16 plan, restore_plain casts the model back to fp32 (its values keep bf16's rounding); packed
    layers come back as trainable as they were (a restore once froze them)."""
    monkeypatch.setattr(accel_apply, "native_bf16", lambda: True)
    model = tiny_model(tie=False)
    accelerate(model, "decode", rows=2, dtype="bf16", budget_s=0.3, fused=False, verify=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    restore_plain(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model = tiny_model(tie=False)
    for name, layer in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:  # as a packed route does
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, PackedLinear(layer))
    restore_plain(model)
    assert all(p.requires_grad for p in model.parameters())
    model(_ids()).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_restore_plain_and_the_off_switch(monkeypatch):
    model = tiny_model(tie=False)
    ref = copy.deepcopy(model)
    accelerate(model, "decode", rows=1, dtype="fp32", budget_s=0.3, fused=False,
               routes=[type("Always", (PackedRoute,), {"name": "always"})()])
    restore_plain(model)
    assert not any(isinstance(m, (PackedLinear, TrainLinear)) for m in model.modules())
    assert not hasattr(model, "accel_plan")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=FP32_ATOL, rtol=FP32_ATOL)
    monkeypatch.setenv(accel_apply.DISABLE_ENV, "0")
    accelerate(model, "decode", rows=1, budget_s=0.3)
    assert all(type(m) is not PackedLinear for m in model.modules()) and not hasattr(model, "accel_plan")


def test_calibration_leaves_the_global_random_stream_alone():
    """A seeded training run draws its dropout masks after ``accelerate``: a cold cache (timings taken) and a warm
    one (nothing taken) must leave torch's generator where they found it."""
    model = tiny_model()
    torch.manual_seed(5)
    accelerate(model, "train", rows=8, dtype="fp32", budget_s=0.3, use_cache=False)
    assert model.accel_plan.calibration_s > 0  # timings were taken (nothing came from a cache)
    after_calibration = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), after_calibration)


def test_generate_leaves_a_plain_model_plain():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, _ids(1, 5), max_new_tokens=4)
    assert all(type(m) is not PackedLinear for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_use_is_a_clear_error():
    with pytest.raises(ValueError, match="for_ must be one of"):
        accelerate(tiny_model(), "serve")


@pytest.mark.parametrize("flag", ["--no-accel", "--no-pack"])
def test_no_accel_flag_and_its_old_name(flag):
    for cmd in (["generate", "--checkpoint", "x", "--prompt", "p"], ["chat", "--message", "hi"]):
        args = build_parser().parse_args([*cmd, flag])
        assert args.no_accel is True


def test_probe_use_keys_name_every_dimension():
    a = calibrate.shape_key(Use("decode", 1, torch.float32), 64, 96, False)
    assert a != calibrate.shape_key(Use("decode", 2, torch.float32), 64, 96, False)
    assert a != calibrate.shape_key(Use("prefill", 1, torch.float32), 64, 96, False)
    assert a != calibrate.shape_key(Use("decode", 1, torch.bfloat16), 64, 96, False)
    assert a != calibrate.shape_key(Use("decode", 1, torch.float32), 64, 96, True)
    assert DenseRoute().convert(nn.Linear(2, 2), Use("decode", 1, torch.float32)) is not None


def test_summary_says_why_a_slightly_faster_route_is_not_taken():
    """A route within the margin of the plain product leaves the plain one (``calibrate.fastest``); the summary
    says so instead of listing a kept route slower than another."""
    plan = accel_apply.AccelPlan("decode", 1, "fp32", shapes={"fp32": [
        accel_apply.ShapeChoice(576, 49152, 1, "dense", {"dense": 4029e-6, "onednn-packed": 3873e-6}),
        accel_apply.ShapeChoice(576, 960, 30, "dense", {"dense": 22e-6, "onednn-packed": 35e-6}),
        accel_apply.ShapeChoice(576, 3072, 30, "onednn-packed", {"dense": 185e-6, "onednn-packed": 148e-6})]},
        dtype_totals_s={"fp32": 0.01})
    lines = plan.summary().splitlines()
    assert calibrate.fastest(plan.shapes["fp32"][0].timings_s) == "dense"
    assert lines[2].endswith("onednn-packed 3873 us; within the 5% margin)")
    assert "margin" not in lines[3] and "margin" not in lines[4]


def test_info_prints_the_chosen_routes_and_timings(tmp_path, capsys, monkeypatch):
    save_pretrained(tiny_model(), tmp_path / "m")
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "accel for decode (1 row/product): dtype fp32" in out
    assert "dense" in out and " us" in out  # every shape with its route and the measured time of each route
    assert "whole decode step: plain" in out  # the fused step's check, with its timings and verdict

    # the documented switch: info says the acceleration is off (it read a plan that was never made)
    monkeypatch.setenv("SEQLAB_ACCEL", "0")
    assert main(["info", str(tmp_path / "m")]) == 0
    assert "acceleration off (SEQLAB_ACCEL=0)" in capsys.readouterr().out
