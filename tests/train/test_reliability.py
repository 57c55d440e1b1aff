"""Nothing lost on a mistake or a signal: one run per directory, checkpoints on SIGTERM, leftovers cleaned, and
evaluation that gives one answer whoever computes it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from seqlab.cli import main
from seqlab.eval.metrics import evaluate
from seqlab.runtime.logbook import Logbook
from seqlab.train import TrainConfig
from seqlab.train import checkpoint as ckpt
from seqlab.train.run import build_datasets, build_tokenizer_for
from tests.train.conftest import TEXT, make_trainer

TINY = ["--preset", "tiny", "--tokenizer", "byte", "--batch-size", "2", "--seq-len", "32", "--no-progress",
        "--log-interval", "1", "--eval-batches", "1", "--warmup-steps", "1"]


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_new_run_never_mixes_with_an_old_one(tmp_path, capsys):
    run = tmp_path / "R"
    assert main(["train", *TINY, "--max-steps", "4", "--ckpt-interval", "2", "--out", str(run)]) == 0
    before = _tree(run)
    capsys.readouterr()
    assert main(["train", *TINY, "--max-steps", "2", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and "--overwrite" in err[0]
    assert _tree(run) == before  # refused before anything was written

    # a bad option is refused before --overwrite moves anything
    missing = str(tmp_path / "nope.txt")
    for bad, said in ((["--seq-len", "0"], "seq_len"), (["--data", missing], "nope.txt: file not found"),
                      (["--init", missing], "--init")):
        assert main(["train", *TINY, "--max-steps", "2", "--out", str(run), "--overwrite", *bad]) == 2
        assert said in capsys.readouterr().err
        assert _tree(run) == before and not list(tmp_path.glob("R.old-*"))

    assert main(["train", *TINY, "--max-steps", "2", "--ckpt-interval", "1", "--out", str(run), "--overwrite"]) == 0
    (old,) = tmp_path.glob("R.old-*")
    assert _tree(old) == before  # moved aside whole, not deleted
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [1, 2]
    assert [r["step"] for r in Logbook(run / "metrics.jsonl", resume_step=10**9).rows()] == [1, 2]


def test_a_run_that_fails_before_writing_leaves_no_empty_folder(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    out = tmp_path / "new"
    assert main(["train", *TINY, "--objective", "mlm", "--data", str(bad), "--out", str(out)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not out.exists()  # made for the run, empty when it failed: taken away again
    out.mkdir()  # a folder that was there before stays, empty or not
    assert main(["train", *TINY, "--objective", "mlm", "--data", str(bad), "--out", str(out)]) == 2
    assert out.is_dir()


def test_resume_into_an_empty_folder_says_it_starts_a_new_run(tmp_path, capsys):
    """A retry loop's first launch passes --resume too, so it starts the run; a mistyped --out is then visible."""
    assert main(["train", *TINY, "--max-steps", "1", "--out", str(tmp_path / "typo"), "--resume"]) == 0
    assert f"--resume: {tmp_path / 'typo'} holds no run yet; starting a new one there" in capsys.readouterr().err
    assert main(["train", *TINY, "--max-steps", "2", "--out", str(tmp_path / "typo"), "--resume"]) == 0
    assert "holds no run yet" not in capsys.readouterr().err


def test_resume_refuses_a_tokenizer_that_disagrees_with_the_config(tmp_path, capsys):
    run = tmp_path / "R"
    assert main(["train", *TINY, "--max-steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--tokenizer", "bpe:300", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json: built for --tokenizer byte" in err and "bpe:300" in err
    # another objective brings another default tokenizer (clm: bpe:2048, seq2seq: byte): the message blamed the
    # tokenizer, which the user never gave, instead of the objective
    run = tmp_path / "D"
    default = [a for a in TINY if a not in ("--tokenizer", "byte")]
    assert main(["train", *default, "--max-steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--objective", "seq2seq", "--no-progress"]) == 2
    assert "cannot resume, the run configuration changed (objective: 'clm' -> 'seq2seq')" in capsys.readouterr().err


def test_leftovers_of_killed_saves_are_removed_at_start(tmp_path):
    make_trainer(tmp_path, steps=2).fit()
    stale = tmp_path / "run" / "checkpoints" / ".tmp-step_00000003-4242"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    t = make_trainer(tmp_path, steps=3, resume=True)
    assert not stale.exists() and t.step == 2


def test_max_steps_below_warmup_warns(tmp_path, capsys):
    make_trainer(tmp_path, steps=2, warmup_steps=5)
    assert "--max-steps 2 is below --warmup-steps 5" in capsys.readouterr().err
    make_trainer(tmp_path, out="ok", steps=6, warmup_steps=2)
    assert "warning" not in capsys.readouterr().err


def test_sigterm_checkpoints_the_current_step_and_exits_143(tmp_path):
    run = tmp_path / "R"
    proc = subprocess.Popen([sys.executable, "-m", "seqlab", "train", *TINY, "--max-steps", "100000",
                             "--ckpt-interval", "0", "--eval-interval", "0", "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
            if len(lines) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "--resume" in err
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    latest = ckpt.latest_checkpoint(run / "checkpoints")
    assert latest is not None and latest.name == f"step_{last:08d}"  # the step it was on, not an older one
    assert 2 <= last < 100000
    state, _, _ = ckpt.load_checkpoint(latest)
    assert state["trainer"]["step"] == last


def test_tensorboard_mirrors_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, tb = tmp_path / "R", tmp_path / "tb"
    assert main(["train", *TINY, "--max-steps", "3", "--out", str(run), "--tensorboard", str(tb)]) == 0
    acc = EventAccumulator(str(tb))
    acc.Reload()
    logged = [(r["step"], r["loss"]) for r in Logbook(run / "metrics.jsonl", resume_step=10**9).rows()]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars("loss")] == logged
    assert "val_loss" in acc.Tags()["scalars"]


def test_trainer_and_seqlab_eval_give_one_answer(tmp_path):
    t = make_trainer(tmp_path, steps=2)
    t.fit()
    mine = t.evaluate()
    rows = t.val_data
    batches = [t.objective.collate(rows[i:i + 4]) for i in range(0, len(rows), 4)]
    theirs = evaluate(t.raw_model, t.objective, batches)
    assert mine["val_targets"] == theirs["n_targets"] and mine["val_bytes"] == theirs["n_bytes"]
    for a, b in (("val_loss", "loss"), ("val_ppl", "perplexity"), ("val_bpb", "bits_per_byte")):
        assert mine[a] == pytest.approx(theirs[b], rel=1e-12)  # same sums, same formulas


def test_dpo_has_no_perplexity_and_its_plot_says_dpo(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(Logbook, "plot", lambda self, png, x, ys, ylabel, *a, **k: seen.setdefault("ylabel", ylabel))
    words = TEXT.split()
    data = [{"prompt": " ".join(words[i:i + 4]), "chosen": words[i + 4], "rejected": words[i + 5][::-1]}
            for i in range(0, 80, 5)]
    t = make_trainer(tmp_path, objective="dpo", data=data, steps=1, plot=True)
    res = t.fit()
    assert "val_loss" in res.eval and not {"val_ppl", "val_bpb"} & res.eval.keys()
    assert seen["ylabel"].startswith("DPO loss")
    assert torch.isfinite(torch.tensor(res.loss))


def test_a_signal_stop_logs_its_step_and_dates_the_last_validation(tmp_path):
    """A stop between log and eval intervals: the step it stops at is in metrics.jsonl (its checkpoint is kept),
    and the result says which step the last validation figures are from."""
    def interrupt_at_3(trainer, record):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    t = make_trainer(tmp_path, steps=50, log_interval=10, eval_interval=3, callbacks=(interrupt_at_3,))
    result = t.fit()
    assert result.signal == signal.SIGINT and result.step == 4
    logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == 4 and ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000004"
    assert result.eval_step == 3 and "val_loss" in result.eval
    resumed = make_trainer(tmp_path, steps=50, log_interval=10, eval_interval=3, resume=True)
    assert resumed.last_eval_step == 3 and resumed.last_eval == result.eval


def test_a_bpe_tokenizer_learns_from_the_training_split_only(tmp_path):
    """BPE was trained on all of --data: words only the held-out validation document has became single tokens,
    which flatters the validation bits per byte."""
    docs = [{"text": "the cat sat on the mat and the dog sat on the log. " * 5} for _ in range(19)]
    docs.append({"text": "zyzzyva quokka " * 50})  # the last document is the validation split's
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = TrainConfig(objective="clm", data=str(tmp_path / "docs.jsonl"), tokenizer="bpe:300",
                      out_dir=str(tmp_path / "run"))
    tok = build_tokenizer_for(cfg, cache_dir=tmp_path)
    _, val = build_datasets(cfg, tok)
    assert any("quokka" in tok.decode(val[i]) for i in range(len(val)))
    assert len(tok.encode(" quokka")) > 3 and not any("quok" in piece for piece in tok.backend.get_vocab())


@pytest.mark.parametrize("objective, row", [
    ("seq2seq", lambda w: {"source": f"{w} {w}", "target": w[::-1]}),
    ("sft", lambda w: {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": f"{w}!"}]}),
    ("dpo", lambda w: {"prompt": w, "chosen": f"{w}.", "rejected": w[::-1]}),
])
def test_a_bpe_tokenizer_of_a_pairs_file_learns_from_its_texts(tmp_path, objective, row):
    """``--tokenizer bpe:N`` with a seq2seq/sft/dpo ``--data`` file learned from the built-in Shakespeare instead,
    so the file's own words stayed byte by byte (日本 as 6 tokens); it learns from the training split's texts."""
    lines = [row("日本語テキスト") for _ in range(19)] + [row("zyzzyvaquokka")]  # the last line: validation
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
    cfg = TrainConfig(objective=objective, data=str(tmp_path / "d.jsonl"), tokenizer="bpe:300",
                      out_dir=str(tmp_path / "run"))
    tok = build_tokenizer_for(cfg, cache_dir=tmp_path)
    assert len(tok.encode("日本語テキスト")) <= 2
    assert not any("quok" in piece for piece in tok.backend.get_vocab())


@pytest.mark.parametrize("objective", ["seq2seq", "sft", "dpo"])
def test_a_bpe_tokenizer_of_the_built_in_examples_learns_from_them(tmp_path, objective):
    """Without --data, sft/dpo/seq2seq's `--tokenizer bpe:N` learned from the play (its last merges 'Ġthou',
    'Ġhave'), not from the chats, pairs or dates the run trains on."""
    from seqlab.data import build_tokenizer
    from seqlab.data.datasets import example_texts

    cfg = TrainConfig(objective=objective, tokenizer="bpe:400", out_dir=str(tmp_path / "run"))
    tok, play = build_tokenizer_for(cfg, cache_dir=tmp_path), build_tokenizer("bpe:400", cache_dir=tmp_path)
    assert "Ġthou" in play.backend.get_vocab() and "Ġthou" not in tok.backend.get_vocab()
    texts = example_texts(objective, None, "train")[:300]
    assert sum(len(tok.encode(t)) for t in texts) < 0.8 * sum(len(play.encode(t)) for t in texts)
