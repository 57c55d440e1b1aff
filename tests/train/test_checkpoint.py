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


def _reseal(path):
    """Re-record every file's sha256 and the state's own digest, as someone who edits a checkpoint can."""
    from seqlab.runtime.store import sha256_file, state_digest

    state = json.loads((path / "state.json").read_text())
    state["files"] = {name: sha256_file(path / name) for name in state["files"]}
    state["state_sha256"] = state_digest(state)
    (path / "state.json").write_text(json.dumps(state))


def _edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    _reseal(path.parent)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.__setitem__("stack.blocks.0.attn.out.weight/exp_avg", torch.zeros(3)),
     r"exp_avg of 'stack.blocks.0.attn.out.weight' is shape \(3,\)"),
    (lambda t: t.pop("stack.blocks.0.attn.out.weight/exp_avg_sq"), r"'stack.blocks.0.attn.out.weight' has no exp_avg_sq"),
])
def test_resume_refuses_optimizer_slots_that_do_not_fit_their_parameter(tmp_path, edit, message):
    """A resized slot (hashes re-recorded) reached the fused AdamW step, which read and wrote past the tensor's end
    (a NaN loss, or heap corruption and an abort); a missing one came back as zeros."""
    make_trainer(tmp_path, steps=2).fit()
    latest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    _edit_tensors(latest / "optimizer.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: the optimizer.*" + message):
        make_trainer(tmp_path, steps=4, resume=True)


def test_resume_refuses_weights_with_a_tensor_missing(tmp_path):
    """torch's full-state-dict loader fills a missing key from the model itself, so its report never named one and
    the resume trained on the fresh initialisation of that tensor."""
    make_trainer(tmp_path, steps=2).fit()
    latest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    _edit_tensors(latest / "model.safetensors", lambda t: t.pop("stack.norm.weight"))
    with pytest.raises(CheckpointError, match=r"do not fit the model \(missing \['stack.norm.weight'\]"):
        make_trainer(tmp_path, steps=4, resume=True)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("trainer"), "no trainer record"),
    (lambda s: s["trainer"].__setitem__("step", "abc"), "trainer.step is 'abc'"),
    (lambda s: s.__setitem__("files", list(s["files"])), "files record is not a table"),
])
def test_resume_refuses_a_damaged_state_record_naming_the_file(tmp_path, edit, message):
    """A state.json without its own digest (as written before it was recorded) and with a field gone or mistyped
    gave a KeyError or AttributeError traceback, or a message naming no file."""
    make_trainer(tmp_path, steps=2).fit()
    latest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    state = json.loads((latest / "state.json").read_text())
    state.pop("state_sha256")
    edit(state)
    (latest / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"state\.json: .*" + message):
        make_trainer(tmp_path, steps=4, resume=True)


def test_a_resave_killed_midway_keeps_the_old_copy(tmp_path, monkeypatch):
    """Re-saving a step moved the old copy aside and deleted it before the new one was in place: a kill then left
    neither, and the start-up cleaning removed both leftovers. Now the old copy is dropped last, and one found
    without its step directory is put back."""
    from seqlab.runtime import store as store_mod

    first = ckpt.save_checkpoint(tmp_path, 5, _sd(), None, {"trainer": {"step": 5}})
    first.rename(tmp_path / ".old-step_00000005-98")  # a kill's leftovers: the old copy aside ...
    (tmp_path / ".tmp-step_00000005-98").mkdir()  # ... and the new one unfinished
    s = ckpt.store(tmp_path)
    removed = s.clean_stale()
    assert [p.name for p in removed] == [".tmp-step_00000005-98"]
    state, _, _ = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["trainer"] == {"step": 5}

    def killed(path, *a, **k):  # the kill lands while the old copy is being deleted
        raise KeyboardInterrupt

    monkeypatch.setattr(store_mod.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 5, _sd(), None, {"trainer": {"step": 55}})
    monkeypatch.undo()
    s.clean_stale()
    state, _, _ = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["trainer"] == {"step": 55}  # the new copy was already in place
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005"]


def test_a_metrics_line_that_is_not_utf8_is_skipped_on_resume(tmp_path):
    """``read_rows`` skips damaged lines; one of invalid UTF-8 stopped the resume with a codec error naming no
    file."""
    make_trainer(tmp_path, steps=2, ckpt_interval=1).fit()
    log = tmp_path / "run" / "metrics.jsonl"
    log.write_bytes(b"\xff\xfe garbage\n" + log.read_bytes())
    make_trainer(tmp_path, steps=3, resume=True).fit()
    assert [json.loads(line)["step"] for line in log.read_text().splitlines() if '"loss"' in line] == [1, 2, 3]
