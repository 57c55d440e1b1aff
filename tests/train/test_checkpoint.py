import json

import pytest
import torch

from seqlab.train import CheckpointError
from seqlab.train import checkpoint as ckpt
from tests.train.conftest import make_trainer


def _sd():
    w = torch.randn(4, 3)
    return {"emb.weight": w, "head.weight": w, "b": torch.arange(3.0)}  # head tied to emb


def test_roundtrip_dedupes_tied_and_keeps_last_k(tmp_path):
    optim = {"state": {"emb.weight": {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["emb.weight", "b"]}]}
    sd = _sd()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, sd, optim, {"trainer": {"step": step}}, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    state, msd, osd = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["step"] == 3 and state["model_aliases"] == {"head.weight": "emb.weight"}
    assert torch.equal(msd["head.weight"], sd["emb.weight"]) and torch.equal(msd["b"], sd["b"])
    assert osd["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(osd["state"]["emb.weight"]["exp_avg"], torch.ones(4, 3))
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_incomplete_temp_dirs_are_ignored(tmp_path):
    ckpt.save_checkpoint(tmp_path, 5, _sd(), None, {})
    (tmp_path / ".tmp-step_00000006-123").mkdir()  # a crash mid-save leaves only a hidden temp dir
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000005"


def test_corrupt_weights_are_refused_with_the_file_named(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, _sd(), None, {})
    f = path / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # flip bits inside a tensor: still a valid safetensors file, silently different weights
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt checkpoint file \(sha256"):
        ckpt.load_checkpoint(path)


def test_truncated_state_and_missing_files_are_refused(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, _sd(), None, {})
    text = (path / "state.json").read_text()
    (path / "state.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"state\.json: corrupt checkpoint state"):
        ckpt.load_checkpoint(path)
    (path / "state.json").write_text(text)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        ckpt.load_checkpoint(path)


def test_trainer_resume_refuses_corrupt_latest(tmp_path):
    t = make_trainer(tmp_path, steps=2)
    t.fit()
    latest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    opt = latest / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-10])  # truncated
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        make_trainer(tmp_path, steps=4, resume=True)


def test_checkpoint_dir_is_a_loadable_model_folder(tmp_path):
    from seqlab.io.checkpoint import load_pretrained

    t = make_trainer(tmp_path, steps=1)
    res = t.fit()
    model = load_pretrained(res.checkpoint)
    x = torch.randint(0, 200, (1, 10))
    torch.testing.assert_close(model(x), t.raw_model.eval()(x), rtol=0, atol=0)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["max_steps"] == 1
