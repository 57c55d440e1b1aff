"""Exact resume (CPU, fp32) and the NaN stop."""

import json

import pytest
import torch

from seqlab.train import StopTraining, TrainingDiverged
from seqlab.train import checkpoint as ckpt
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
