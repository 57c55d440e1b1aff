"""Exact resume (CPU, fp32) and the NaN stop."""

import json

import pytest
import torch

from seqlab.objectives import DPO, CausalLM
from seqlab.train import StopTraining, TrainingDiverged
from seqlab.train import checkpoint as ckpt
from seqlab.train.guards import check_unchanged
from tests.train.conftest import make_trainer


def _stop_at(step):
    def cb(trainer, record):
        if trainer.step == step:
            raise StopTraining
    return cb


@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_resume_repeats_the_uninterrupted_run(tmp_path, objective):
    N, M = 4, 4
    # dropout > 0 so the RNG state must be restored too; MLM also draws its masks from the objective's state
    kw = dict(steps=N + M, dropout=0.1, objective=objective, ckpt_interval=N, batch_size=3)
    full = make_trainer(tmp_path, out="full", **kw).fit()

    first = make_trainer(tmp_path, out="cut", callbacks=[_stop_at(N)], **kw)
    first.fit()  # "killed" right after the step-N checkpoint
    assert ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints").name == f"step_{N:08d}"
    torch.manual_seed(12345)  # a fresh process would not share the RNG position: resume must restore it
    resumed = make_trainer(tmp_path, out="cut", resume=True, **kw)
    assert resumed.step == N
    rest = resumed.fit()

    assert len(full.losses) == N + M and len(rest.losses) == M
    for a, b in zip(full.losses[N:], rest.losses):
        assert abs(a - b) <= 1e-6
    # the metrics file reads as one run, without duplicated steps
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, N + M + 1))


def test_resume_refuses_a_changed_config(tmp_path):
    make_trainer(tmp_path, steps=2).fit()
    with pytest.raises(ckpt.CheckpointError, match="lr: 0.003 -> 0.01"):
        make_trainer(tmp_path, steps=4, resume=True, lr=1e-2)


def test_nan_loss_stops_and_names_the_step(tmp_path):
    def poison(trainer, record):
        if trainer.step == 2:
            with torch.no_grad():
                next(trainer.raw_model.parameters()).fill_(float("nan"))

    t = make_trainer(tmp_path, steps=6, ckpt_interval=2, callbacks=[poison])
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3 .*last good checkpoint is .*step_00000002"):
        t.fit()
    names = [p.name for _, p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step_00000002"]
    logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]


def test_a_non_finite_gradient_stops_before_the_update(tmp_path):
    """A finite loss with an infinite gradient: the update would put NaN into every weight AdamW touches."""
    def blow_up(trainer, record):
        if trainer.step == 2:
            next(trainer.raw_model.parameters()).register_hook(lambda g: g * float("inf"))

    t = make_trainer(tmp_path, steps=6, ckpt_interval=2, callbacks=[blow_up])
    with pytest.raises(TrainingDiverged, match=r"gradient norm is (inf|nan) at step 3 .*the loss, .*, is finite.*"
                                               r"last good checkpoint is .*step_00000002"):
        t.fit()
    assert all(torch.isfinite(p).all() for p in t.raw_model.parameters())  # stopped before the optimizer step
    assert t.step == 2


def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path):
    """A huge lr (above float32's range) gives a finite loss and gradient at step 1 but infinite weights after it:
    the step-1 checkpoint must not be written (before, it was, and the NaN at step 2 named it "the last good
    checkpoint")."""
    t = make_trainer(tmp_path, steps=6, ckpt_interval=1, lr=1e40)
    with pytest.raises(TrainingDiverged, match=r"weights after step 1 are not finite \(\S+ holds NaN or inf; "
                                               r"lr=.*\); .*no checkpoint was written yet"):
        t.fit()
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_save_refuses_poisoned_weights_and_names_the_last_good_checkpoint(tmp_path):
    t = make_trainer(tmp_path, steps=2)
    t.fit()
    with torch.no_grad():
        dict(t.raw_model.named_parameters())["stack.blocks.1.mlp.up.weight"][0, 0] = float("inf")
    t.step += 1
    with pytest.raises(TrainingDiverged, match=r"stack\.blocks\.1\.mlp\.up\.weight holds NaN or inf.*"
                                               r"last good checkpoint is .*step_00000002"):
        t.save()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


@pytest.mark.parametrize("max_steps", [2, 3])
def test_resume_refuses_max_steps_below_the_checkpoint(tmp_path, max_steps):
    make_trainer(tmp_path, steps=4).fit()
    config = (tmp_path / "run" / "config.json").read_bytes()
    with pytest.raises(ckpt.CheckpointError, match=f"--max-steps {max_steps} is below the checkpoint's step 4"):
        make_trainer(tmp_path, steps=max_steps, resume=True)
    assert (tmp_path / "run" / "config.json").read_bytes() == config  # not rewritten with the refused max_steps


def test_a_finished_run_resumed_finishes_again(tmp_path):
    """A retry or a restart of a run that already reached --max-steps trains nothing and ends as it was."""
    make_trainer(tmp_path, steps=4).fit()
    assert make_trainer(tmp_path, steps=4, resume=True).fit().step == 4


def test_resume_with_more_steps_warns_how_the_lr_moves(tmp_path, capsys):
    from seqlab.train.schedule import LRSchedule

    make_trainer(tmp_path, steps=4, warmup_steps=1).fit()
    capsys.readouterr()
    t = make_trainer(tmp_path, steps=10, warmup_steps=1, resume=True)
    before, after = LRSchedule(t.cfg.replace(max_steps=4))(4), LRSchedule(t.cfg)(4)
    assert before != after
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[seqlab] warning: --max-steps 10 (the run had 4) re-stretches the learning-rate schedule: the LR "
                   f"at the resumed step 4 changes from {before:.4g} to {after:.4g}"]
    assert t.fit().step == 10  # still allowed


def test_a_changed_init_is_refused_only_where_it_is_the_reference(tmp_path):
    """After a resume the weights come from the checkpoint, so clm may drop or move its ``--init``; DPO rebuilds
    its frozen reference from ``--init``, so there a change would silently change the loss being optimised."""
    make_trainer(tmp_path, out="sft", steps=1).fit()
    make_trainer(tmp_path, steps=2, init=str(tmp_path / "sft")).fit()
    assert make_trainer(tmp_path, steps=4, resume=True).fit().step == 4  # clm: allowed
    old, new = {"init": "runs/sft", "lr": 1e-3}, {"init": "runs/other", "lr": 1e-3}
    check_unchanged("ckpt", old, new)
    with pytest.raises(ckpt.CheckpointError, match=r"init: 'runs/sft' -> 'runs/other'"):
        check_unchanged("ckpt", old, new, frozen=frozenset({"init"}))
    assert DPO.uses_initial_model and not CausalLM.uses_initial_model
