import json

import pytest
import torch

from seqlab.runtime import CheckpointError
from seqlab.runtime.store import CheckpointStore, load_optimizer_state, optimizer_state_to_tensors


def _model_sd():
    w = torch.randn(4, 3)
    return {"emb.weight": w, "head.weight": w, "b": torch.arange(3.0)}  # head tied to emb


def test_save_load_roundtrip_with_aliases_extra_files_and_keep_last(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, kind="test-ckpt")
    sd = _model_sd()
    for step in (1, 2, 3):
        store.save(step, {"model": sd}, {"note": step}, files={"config.json": b"{}\n"})
    assert [s for s, _ in store.list()] == [2, 3] and store.latest().name == "step_00000003"
    tensors, state = store.load(store.latest())
    assert state["step"] == 3 and state["note"] == 3 and state["model_aliases"] == {"head.weight": "emb.weight"}
    assert set(state["files"]) == {"model.safetensors", "config.json"}
    assert torch.equal(tensors["model"]["head.weight"], sd["emb.weight"]) and torch.equal(tensors["model"]["b"], sd["b"])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_wrong_kind_corrupt_and_truncated_files_are_refused_by_name(tmp_path):
    store = CheckpointStore(tmp_path, kind="test-ckpt")
    path = store.save(1, {"model": _model_sd()}, {})
    with pytest.raises(CheckpointError, match="not a other-kind"):
        CheckpointStore(tmp_path, kind="other-kind").load(path)
    f = path / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # still a valid safetensors file, silently different weights: only the hash can tell
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt checkpoint file \(sha256"):
        store.load(path)
    text = (path / "state.json").read_text()
    (path / "state.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"state\.json: corrupt checkpoint state"):
        store.load(path)


def test_a_changed_state_json_is_refused_though_it_is_valid_json(tmp_path):
    """state.json holds the step, the data position, the RNG and the optimiser's step counts: one flipped bit
    (still valid JSON) resumed a different run silently. Its own sha256 covers it; what round-trips through JSON
    (tuples, integer keys, floats) hashes alike when written and read back."""
    store = CheckpointStore(tmp_path)
    state = {"trainer": {"step": 2, "sampler": {"step_in_epoch": 2}}, "betas": (0.9, 0.99), "ids": {3: "a", 10: "b"},
             "lr": 0.1 + 0.2, "nan": float("nan")}
    path = store.save(2, {"model": _model_sd()}, state)
    assert store.load(path)[1]["trainer"]["sampler"]["step_in_epoch"] == 2
    raw = bytearray((path / "state.json").read_bytes())
    at = raw.index(b'"step_in_epoch": 2') + len(b'"step_in_epoch": ')
    raw[at] ^= 0x01  # '2' -> '3'
    (path / "state.json").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"state\.json: corrupt checkpoint state \(its content no longer matches"):
        store.load(path)


def test_clean_stale_removes_leftovers_of_killed_saves_only(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(5, {"model": _model_sd()}, {})
    (tmp_path / ".tmp-step_00000006-123").mkdir()  # a kill mid-save leaves only a hidden temp dir
    (tmp_path / ".tmp-step_00000006-123" / "model.safetensors").write_bytes(b"x")
    assert store.latest().name == "step_00000005"
    removed = store.clean_stale()
    assert [p.name for p in removed] == [".tmp-step_00000006-123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]


def test_optimizer_state_roundtrips_through_safetensors_bit_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight], "lr_scale": 1.0}, {"params": [model.bias], "lr_scale": 0.5}]
    opt = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    tensors, meta = optimizer_state_to_tensors(opt)
    store = CheckpointStore(tmp_path)
    path = store.save(2, {"model": model.state_dict(), "optimizer": tensors}, {"optimizer": meta})
    assert json.loads((path / "state.json").read_text())["optimizer"]["param_groups"][1]["lr_scale"] == 0.5

    loaded, state = store.load(path)
    model2 = torch.nn.Linear(3, 2)
    model2.load_state_dict(loaded["model"])
    opt2 = torch.optim.AdamW([{"params": [model2.weight], "lr_scale": 1.0}, {"params": [model2.bias], "lr_scale": 0.5}],
                             lr=0.01, betas=(0.9, 0.95))
    load_optimizer_state(opt2, loaded["optimizer"], state["optimizer"])
    x = torch.randn(5, 3)
    for m, o in ((model, opt), (model2, opt2)):  # one more step each: identical moments give identical weights
        m(x).square().sum().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight) and torch.equal(model.bias, model2.bias)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
