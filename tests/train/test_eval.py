"""`seqlab eval` scores a checkpoint as the trainer scored it: the same validation set (the run's --val-data),
the same DPO reference (the run's initial model, --init included) and, with --precision auto, the same precision."""

import json
import math
import shutil

import pytest
import torch

from seqlab.cli import main
from tests.train.conftest import TEXT
from tests.train.test_cli import TINY


def _last_val(run):
    """The last metrics.jsonl record that holds an evaluation."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r][-1]


def _eval(run, out, *extra):
    assert main(["eval", str(run), "--json", str(out), "--no-progress", *extra]) == 0
    return json.loads(out.read_text())


def test_dpo_eval_measures_against_the_runs_reference(tmp_path, capsys):
    """Before, eval used the trained policy as its own reference, and every DPO loss read ln 2."""
    first, second = tmp_path / "first", tmp_path / "second"
    dpo = ["train", "--objective", "dpo", *TINY, "--seq-len", "256", "--precision", "fp32", "--lr", "1e-2"]
    assert main([*dpo, "--out", str(first), "--max-steps", "3"]) == 0
    # a second run starting from the first: its reference is the first run's weights, not a seeded init
    assert main([*dpo, "--out", str(second), "--max-steps", "2", "--init", str(first)]) == 0
    for run in (first, second):
        res = _eval(run, tmp_path / f"{run.name}.json", "--max-batches", "2", "--batch-size", "4",
                    "--precision", "fp32")
        logged = _last_val(run)
        assert res["n_targets"] == logged["val_targets"]
        assert res["loss"] == pytest.approx(logged["val_loss"], rel=1e-6)
        assert abs(res["loss"] - math.log(2)) > 1e-4  # the policy moved away from its reference
    # the second run recorded the checkpoint its --init meant then; the first run moving on changes nothing
    pinned = str((first / "checkpoints" / "step_00000003").resolve())
    assert json.loads((second / "config.json").read_text())["train"]["init"] == pinned
    before = _eval(second, tmp_path / "before.json", "--max-batches", "2", "--batch-size", "4", "--precision", "fp32")
    assert main([*dpo, "--out", str(first), "--max-steps", "5", "--resume"]) == 0
    after = _eval(second, tmp_path / "after.json", "--max-batches", "2", "--batch-size", "4", "--precision", "fp32")
    assert after["loss"] == before["loss"]
    assert main([*dpo, "--out", str(second), "--max-steps", "3", "--resume"]) == 0  # resumes with the pinned one
    # the first run prunes (or loses) the checkpoint the second was pinned to: the second keeps its own copy of
    # those weights, so its evaluation and its resume are unchanged
    assert (second / "init_weights.safetensors").is_file() and not (first / "init_weights.safetensors").exists()
    scored = ["--max-batches", "2", "--batch-size", "4", "--precision", "fp32"]
    there = _eval(second, tmp_path / "there.json", *scored)
    shutil.rmtree(first)
    assert _eval(second, tmp_path / "gone.json", *scored)["loss"] == there["loss"]
    assert main([*dpo, "--out", str(second), "--max-steps", "4", "--resume"]) == 0
    assert _last_val(second)["step"] == 4
    # the kept weights are checked: a flipped bit, or a cut file, is refused naming it (a cut one gave a traceback)
    kept = second / "init_weights.safetensors"
    data = bytearray(kept.read_bytes())
    data[-3] ^= 0x40
    kept.write_bytes(bytes(data))
    for args in (["eval", str(second), "--no-progress"], [*dpo, "--out", str(second), "--max-steps", "5", "--resume"]):
        assert main(args) != 0
        assert "init_weights.safetensors: its sha256 differs" in capsys.readouterr().err
    (second / "init_weights.sha256").unlink()  # as in a run made before the digest: the parse still names the file
    kept.write_bytes(bytes(data[: len(data) // 2]))
    assert main(["eval", str(second), "--no-progress"]) != 0
    assert "init_weights.safetensors: " in capsys.readouterr().err


def test_eval_scores_the_runs_val_data(tmp_path):
    data, val = tmp_path / "train.txt", tmp_path / "val.txt"
    data.write_text(TEXT * 3)
    val.write_text(TEXT[:300])  # a different size from the held-out 5 % of data.txt
    run = tmp_path / "run"
    assert main(["train", "--objective", "clm", "--data", str(data), "--val-data", str(val), "--tokenizer", "byte",
                 "--out", str(run), "--max-steps", "2", *TINY, "--precision", "fp32"]) == 0
    res, logged = _eval(run, tmp_path / "e.json", "--max-batches", "2", "--batch-size", "4"), _last_val(run)
    assert res["data"] == str(val)
    assert (res["n_targets"], res["n_bytes"]) == (logged["val_targets"], logged["val_bytes"])
    assert res["bits_per_byte"] == pytest.approx(logged["val_bpb"], rel=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # one of the two differs from what auto picks on a CPU
def test_eval_precision_auto_evaluates_as_the_run_did(tmp_path, precision):
    run = tmp_path / "run"
    assert main(["train", "--objective", "clm", "--tokenizer", "byte", "--out", str(run), "--max-steps", "2",
                 *TINY, "--precision", precision]) == 0
    res, logged = _eval(run, tmp_path / "e.json", "--precision", "auto", "--max-batches", "2", "--batch-size", "4"), \
        _last_val(run)
    # Same weights, batches and precision: the same arithmetic (bit-identical when measured). The other precision
    # moves this tiny model's bits per byte by ~5e-6 relative, 5000x the tolerance.
    assert res["bits_per_byte"] == pytest.approx(logged["val_bpb"], rel=1e-9)
    assert res["precision"] == precision


@pytest.mark.parametrize("flag,value", [("--max-batches", "0"), ("--max-batches", "-1"), ("--batch-size", "0")])
def test_eval_refuses_fewer_than_one_batch(tmp_path, capsys, flag, value):
    """--max-batches 0 used to print loss 0.0000 and perplexity 1.0000 as if they had been measured."""
    assert main(["eval", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"seqlab eval: error: {flag} must be at least 1, got {value}"]


def test_auto_scores_an_fp16_gpu_run_in_fp32_on_a_cpu():
    from seqlab.train.evaluate import _eval_precision

    cpu = torch.device("cpu")
    assert _eval_precision("auto", "fp16", cpu).name == "fp32"  # not "fp16 needs a GPU"
    assert _eval_precision("auto", "fp32", cpu).name == "fp32" and _eval_precision("fp32", "bf16", cpu).name == "fp32"


def test_eval_of_a_file_takes_its_split_when_asked(tmp_path):
    """`seqlab eval RUN --data FILE --split train` scored the whole file and said split=all: --split was ignored."""
    run, data = tmp_path / "run", tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i}: " + TEXT[:80]}) + "\n" for i in range(40)))
    assert main(["train", "--objective", "clm", "--tokenizer", "byte", "--out", str(run), "--max-steps", "1",
                 *TINY, "--precision", "fp32"]) == 0
    whole = _eval(run, tmp_path / "a.json", "--data", str(data))
    parts = [_eval(run, tmp_path / f"{s}.json", "--data", str(data), "--split", s) for s in ("train", "validation")]
    assert whole["split"] == "all" and [p["split"] for p in parts] == ["train", "validation"]
    assert parts[0]["n_bytes"] + parts[1]["n_bytes"] == whole["n_bytes"] and parts[1]["n_bytes"] < parts[0]["n_bytes"]


def test_eval_refuses_an_unknown_precision(tmp_path, capsys):
    """`seqlab eval --precision foo` printed a loss as if foo were a precision."""
    with pytest.raises(SystemExit):
        main(["eval", str(tmp_path), "--precision", "foo"])
    assert "invalid choice: 'foo'" in capsys.readouterr().err
    from seqlab.train.precision import resolve_precision
    with pytest.raises(ValueError, match="--precision: fp16 needs a GPU"):
        resolve_precision("fp16", torch.device("cpu"), "--precision")


def test_eval_with_nothing_to_score_is_an_error_not_a_perfect_model(tmp_path, capsys):
    """An MLM run scored on a one-character file has no masked targets: `seqlab eval` printed loss 0.0000 and
    perplexity 1.0000."""
    run, tiny = tmp_path / "run", tmp_path / "tiny.txt"
    tiny.write_text("x\n")
    assert main(["train", "--objective", "mlm", "--tokenizer", "byte", "--out", str(run), "--max-steps", "1",
                 *TINY, "--precision", "fp32"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(tiny), "--no-progress"]) == 2
    assert "nothing to score" in capsys.readouterr().err
