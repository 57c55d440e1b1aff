import math

import pytest

from seqlab.train import TrainConfig, TrainConfigError
from seqlab.train.optim import build_optimizer, param_groups
from seqlab.train.schedule import LRSchedule
from tests.train.conftest import make_trainer, tiny_model


def test_warmup_then_cosine_to_floor():
    cfg = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    s = LRSchedule(cfg)
    assert s(0) == pytest.approx(1 / 11)
    assert s(9) == pytest.approx(10 / 11)
    assert s(10) == pytest.approx(1.0)  # cosine starts at the peak
    assert s(55) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)
    assert s(100) == pytest.approx(0.1)
    lrs = [s(i) for i in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay after warmup


def test_time_budget_drives_progress():
    cfg = TrainConfig(max_steps=10**6, max_time_s=100.0, warmup_frac=0.1, lr=1.0, min_lr_ratio=0.0)
    s = LRSchedule(cfg)
    assert s.progress(5, 50.0) == pytest.approx(0.5)
    assert s(5, 5.0) == pytest.approx(0.5)  # halfway through the warmup fraction
    assert s(5, 55.0) == pytest.approx(0.5)  # cosine midpoint: (55-10)/90 = 0.5
    assert s(5, 100.0) == pytest.approx(0.0)


def test_step_warmup_under_a_time_budget_hands_the_cosine_its_peak():
    """--warmup-steps with --max-time: the cosine starts at the peak where warmup leaves it and decays smoothly to
    the floor when the budget ends (it started at 0.63 of the peak after 0.99 the step before: its start was
    counted in steps, its progress in time)."""
    cfg = TrainConfig(lr=1.0, max_steps=1000, warmup_steps=100, max_time_s=60.0, min_lr_ratio=0.1)
    s = LRSchedule(cfg)
    lrs = [s(step, 0.3 * step) for step in range(201)]  # 0.3 s a step: the budget ends at step 200
    assert lrs[99] == pytest.approx(100 / 101) and lrs[100] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:])) and lrs[101] > 0.999
    assert lrs[200] == pytest.approx(0.1)


def test_a_warmup_fraction_starts_as_the_same_warmup_in_steps_does():
    """The first update of a 10 % warmup over 1000 steps is lr / 101, as with --warmup-steps 100 (it was
    lr / 1001: the first update all but wasted)."""
    frac = LRSchedule(TrainConfig(lr=1.0, max_steps=1000, warmup_frac=0.1))
    steps = LRSchedule(TrainConfig(lr=1.0, max_steps=1000, warmup_steps=100))
    assert frac(0) == pytest.approx(steps(0)) == pytest.approx(1 / 101)


def test_a_time_budget_too_short_for_the_warmup_steps_still_reaches_the_peak_and_decays():
    """--max-time 60 with the default 100 warmup steps at 1 s a step: the run ended at step 60 still in warmup, at
    0.59 of the peak, never decayed (docs: a time budget always ends fully decayed). Warmup now ends by half the
    budget at the latest."""
    s = LRSchedule(TrainConfig(lr=1.0, max_time_s=60.0, warmup_steps=100, min_lr_ratio=0.1))
    lrs = [s(step, 1.0 * (step + 1)) for step in range(60)]  # progress counts the step's own time
    assert lrs[0] == pytest.approx(1 / 101) and max(lrs) == pytest.approx(1.0, abs=0.02)
    peak = lrs.index(max(lrs))
    assert 27 <= peak <= 30 and all(a <= b for a, b in zip(lrs[:peak], lrs[1:peak + 1]))
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and lrs[-1] == pytest.approx(0.1)


def test_a_warmup_fraction_ramps_as_the_same_warmup_in_steps_does():
    """Steps 0 and 1 of a 10 % warmup over 1000 steps both took about lr / 100, and every later step sat one behind
    --warmup-steps 100."""
    frac = LRSchedule(TrainConfig(lr=1.0, max_steps=1000, warmup_frac=0.1))
    steps = LRSchedule(TrainConfig(lr=1.0, max_steps=1000, warmup_steps=100))
    assert [frac(i) for i in range(0, 1001, 7)] == pytest.approx([steps(i) for i in range(0, 1001, 7)])


def test_a_warmup_fraction_under_a_time_budget_does_not_waste_its_first_update(tmp_path):
    """With a time budget the first update's progress counts its own compute: it was taken at progress 0, at
    lr / (warmup_frac x max_steps + 1), lr / 500001 here (the demo's recipe: lr / 30001)."""
    trainer = make_trainer(tmp_path, steps=10**6, max_time_s=10.0, warmup_frac=0.5, warmup_steps=0, lr=1.0)
    first = trainer.train_step()["lr"]  # its own step's time over the budget's warmup: about 1e-3 (and >= 1e-5)
    assert 10 / (0.5 * 10**6 + 1) < first < 1.0


@pytest.mark.parametrize("seconds", [0.0, -5.0, float("inf"), float("nan")])
def test_eval_and_time_intervals_must_be_positive_seconds(seconds):
    """eval_interval_s=0 divided by zero in the trainer and a negative one looped for ever (ignoring SIGTERM)."""
    for name in ("eval_interval_s", "max_time_s"):
        with pytest.raises(TrainConfigError, match=f"TrainConfig.{name}: must be a positive finite number"):
            TrainConfig(**{name: seconds})


def test_no_decay_on_vectors_and_tied_weights_counted_once(tok):
    model = tiny_model(tok)  # tied embeddings
    groups = param_groups(model, 0.1)
    decay, no_decay = groups
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})
    assert any("norm" in n for n in no_decay["names"])
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_config_errors_name_the_field():
    with pytest.raises(TrainConfigError, match="TrainConfig.batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(TrainConfigError, match="TrainConfig.precision"):
        TrainConfig(precision="fp8")
    with pytest.raises(TrainConfigError, match="unknown field"):
        TrainConfig.from_dict({"learning_rate": 1.0})
