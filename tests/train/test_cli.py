"""CLI smoke: `seqlab train` (every objective), `--resume`, `seqlab eval`, `seqlab demo`, with tiny presets."""

import json

import pytest

from seqlab.cli import main
from tests.train.conftest import TEXT

TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--no-progress", "--log-interval", "1",
        "--eval-batches", "2", "--warmup-steps", "1"]


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "plays.txt"
    p.write_text(TEXT * 3)
    return p


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_resume_eval(tmp_path, text_file, capsys):
    run = tmp_path / "clm"
    args = ["train", "--objective", "clm", "--data", str(text_file), "--tokenizer", "byte", "--out", str(run),
            "--ckpt-interval", "2", *TINY]
    assert main([*args, "--max-steps", "4"]) == 0
    assert "[seqlab] timed on this CPU: " in capsys.readouterr().out  # which measured kernels the run took
    recs = _metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all({"step", "loss", "lr", "tokens_per_s"} <= r.keys() for r in recs)
    assert "val_bpb" in recs[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert (run / "loss_curve.png").stat().st_size > 1000

    assert main(["train", "--out", str(run), "--resume", "--max-steps", "6", "--no-progress"]) == 0
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "step_00000006").is_dir()

    capsys.readouterr()
    assert main(["eval", str(run), "--json", str(tmp_path / "eval.json"), "--precision", "auto"]) == 0
    out = capsys.readouterr().out
    assert "bits_per_byte" in out and "step_00000006" in out
    res, logged = json.loads((tmp_path / "eval.json").read_text()), _metrics(run)[-1]
    # The same text was scored: these are integer counts, equal exactly.
    assert (res["n_bytes"], res["n_targets"]) == (logged["val_bytes"], logged["val_targets"])
    # Same weights, same precision (auto: bf16 autocast on a CPU with native bf16, fp32 elsewhere), same batches:
    # the same arithmetic, so only a different summation order could move the result, far below 1e-6.
    assert res["bits_per_byte"] == pytest.approx(logged["val_bpb"], rel=1e-6)
    # The default eval is fp32; the run evaluated under autocast. bf16 keeps 8 bits of mantissa, so activations
    # differ by up to ~0.4 % each, averaged over every scored byte; a different split or byte count moves bpb by
    # far more than 1e-3.
    assert main(["eval", str(run), "--json", str(tmp_path / "eval32.json"), "--no-progress"]) == 0
    res32 = json.loads((tmp_path / "eval32.json").read_text())
    assert res32["bits_per_byte"] == pytest.approx(logged["val_bpb"], rel=1e-3)


@pytest.mark.parametrize("objective", ["mlm", "seq2seq", "sft", "dpo"])
def test_every_objective_trains_from_the_cli(tmp_path, text_file, objective):
    run = tmp_path / objective
    extra = ["--data", str(text_file), "--tokenizer", "byte"] if objective == "mlm" else ["--seq-len", "256"]
    assert main(["train", "--objective", objective, "--out", str(run), "--max-steps", "2", *TINY, *extra]) == 0
    recs = _metrics(run)
    assert recs[-1]["step"] == 2 and recs[-1]["loss"] is not None and "val_loss" in recs[-1]
    state = json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["train_config"]["objective"] == objective


def test_embed_reads_an_mlm_run(tmp_path, text_file, capsys):
    """`seqlab embed --model` takes a seqlab encoder run as well as a Hugging Face folder, with the [BOS] ... [EOS]
    rows it was trained on; a decoder run is refused by name."""
    import torch

    from seqlab.cli.embed import load_embedder
    from seqlab.eval.embeddings import sentence_embeddings

    run = tmp_path / "mlm"
    assert main(["train", "--objective", "mlm", "--out", str(run), "--max-steps", "1", *TINY, "--data", str(text_file),
                 "--tokenizer", "byte"]) == 0
    capsys.readouterr()
    assert main(["embed", "--model", str(run), "to be", "or not", "to be"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    v = torch.tensor([r["embedding"] for r in rows])
    model, tokenizer, max_length = load_embedder(run)
    assert v.shape == (3, model.config.d_model) and torch.allclose(v.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.equal(v[0], v[2]) and not torch.allclose(v[0], v[1])
    assert tokenizer.encode("to", add_special_tokens=True) == [tokenizer.bos_id, *tokenizer.encode("to"), tokenizer.eos_id]
    direct = sentence_embeddings(model, tokenizer, ["to be", "or not"], max_length=max_length)
    assert torch.allclose(direct, v[:2], atol=1e-6)

    clm = tmp_path / "clm"
    assert main(["train", "--out", str(clm), "--max-steps", "1", *TINY, "--data", str(text_file), "--tokenizer",
                 "byte"]) == 0
    capsys.readouterr()
    assert main(["embed", "--model", str(clm), "hi"]) == 2
    assert "need an encoder" in capsys.readouterr().err


def test_bad_data_file_gives_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a", "target": "b"}\n{"source": "a"\n')
    code = main(["train", "--objective", "seq2seq", "--data", str(bad), "--out", str(tmp_path / "r"), *TINY])
    assert code == 2
    assert f"{bad}:2" in capsys.readouterr().err


def test_a_run_failing_at_its_first_step_leaves_no_folder_so_the_fixed_command_runs(tmp_path, capsys):
    """SFT answers cut off by a short --seq-len are found at step 1, after the run wrote its config and tokenizer:
    that folder blocked the corrected command ("already holds a run") until it was removed by hand."""
    run = tmp_path / "sft"
    args = ["train", "--objective", "sft", "--out", str(run), "--max-steps", "1", *TINY]
    assert main(args) == 2
    assert "try a larger --seq-len" in capsys.readouterr().err and not run.exists()
    assert main([*args, "--seq-len", "256"]) == 0 and (run / "checkpoints" / "step_00000001").is_dir()


def test_data_paths_are_recorded_absolute(tmp_path, text_file, monkeypatch):
    """A relative --data was stored as typed: `seqlab eval` from another folder read another file of that name (or
    none), and --resume there refused the same file named by another relative path."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    (here / "plays.txt").write_text(text_file.read_text())
    (elsewhere / "plays.txt").write_text("a different text " * 200)
    monkeypatch.chdir(here)
    base = ["train", "--objective", "clm", "--tokenizer", "byte", "--out", str(tmp_path / "run"), *TINY]
    assert main([*base, "--data", "plays.txt", "--max-steps", "2"]) == 0
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]["data"]
    assert recorded == str(here / "plays.txt")
    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(tmp_path / "run"), "--json", str(tmp_path / "e.json"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["n_bytes"] == _metrics(tmp_path / "run")[-1]["val_bytes"]
    assert main([*base, "--data", "../here/plays.txt", "--max-steps", "3", "--resume"]) == 0
    # a tokenizer file likewise: recorded absolute, and the same file under another relative name resumes
    (here / "tok.json").write_bytes((tmp_path / "run" / "tokenizer.json").read_bytes())
    monkeypatch.chdir(here)
    other = ["train", "--objective", "clm", "--data", "plays.txt", "--out", str(tmp_path / "run2"), *TINY]
    assert main([*other, "--tokenizer", "tok.json", "--max-steps", "2"]) == 0
    assert json.loads((tmp_path / "run2" / "config.json").read_text())["train"]["tokenizer"] == str(here / "tok.json")
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--out", str(tmp_path / "run2"), "--tokenizer", "../here/tok.json", "--resume",
                 "--max-steps", "3", "--no-progress"]) == 0


def test_a_moved_or_copied_data_file_resumes(tmp_path, text_file, capsys):
    """The run's --data moved (its recorded path gone) or copied byte for byte: a resume naming it where it is now
    goes on; a plain resume says how; a file with other bytes, the recorded one still there, is refused."""
    run = tmp_path / "run"
    base = ["train", "--objective", "clm", "--tokenizer", "byte", "--out", str(run), *TINY]
    assert main([*base, "--data", str(text_file), "--max-steps", "2"]) == 0
    copy = tmp_path / "copy.txt"
    copy.write_bytes(text_file.read_bytes())
    assert main(["train", "--out", str(run), "--resume", "--data", str(copy), "--max-steps", "3", "--no-progress"]) == 0
    moved = tmp_path / "moved" / "plays.txt"
    moved.parent.mkdir()
    copy.rename(moved)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    assert "resume with --data naming it where it is now" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--data", str(moved), "--max-steps", "4", "--no-progress"]) == 0
    assert json.loads((run / "config.json").read_text())["train"]["data"] == str(moved)
    text_file.write_text(text_file.read_text() + "more\n")  # a live file with other bytes: another data set
    assert main(["train", "--out", str(run), "--resume", "--data", str(text_file), "--max-steps", "5",
                 "--no-progress"]) == 2
    assert "the run configuration changed (data:" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_writes_summary(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--time", "3", "--preset", "tiny", "--samples", "1",
                 "--max-new-tokens", "8", "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    for key in ("val_bits_per_byte", "val_loss", "train_seconds", "tokens_seen", "samples"):
        assert key in s
    assert 0 < s["val_bits_per_byte"] < 16 and s["tokens_seen"] > 0 and s["train_seconds"] >= 3
    assert s["samples"][0]["prompt"] and isinstance(s["samples"][0]["completion"], str)
