"""`seqlab train` refuses bad input with one line naming the flag, field or file, before it writes a run."""

import pytest

from seqlab.cli import main
from seqlab.data import ByteTokenizer, build_dataset
from seqlab.io import load_pretrained, save_pretrained
from seqlab.train.config import TrainConfig
from seqlab.train.run import build_datasets, dataset_options
from seqlab.train.rundir import existing_run
from tests.train.test_cli import TINY

ONE_PAIR = '{"source": "a", "target": "b"}\n'

CASES = [  # (id, extra args ("{tmp}" is the test's folder), what the one stderr line must contain)
    ("lr-inf", ["--lr", "inf"], "TrainConfig.lr: must be a positive finite number, got inf"),
    ("lr-nan", ["--lr", "nan"], "TrainConfig.lr: must be a positive finite number, got nan"),
    ("weight-decay-nan", ["--weight-decay", "nan"], "TrainConfig.weight_decay: must be a finite number, got nan"),
    ("threads-0", ["--threads", "0"], "(--threads) must be a positive integer, got 0"),
    ("threads-negative", ["--threads", "-2"], "(--threads) must be a positive integer, got -2"),
    ("eval-batch-size-0", ["--eval-batch-size", "0"], "(--eval-batch-size) must be a positive integer, got 0"),
    ("eval-batches-0", ["--eval-batches", "0"], "(--eval-batches) must be a positive integer, got 0"),
    ("dpo-beta-text", ["--objective", "dpo", "--objective-arg", "beta=abc"], "(--objective-arg) objective 'dpo': "
                                                                             "option beta='abc' must be a number"),
    ("dpo-reference", ["--objective", "dpo", "--objective-arg", "reference=1"], "option reference=1 must be"),
    ("dpo-max-len-text", ["--objective", "dpo", "--objective-arg", "max_len=abc"], "max_len='abc' must be an integer"),
    ("mlm-mask-prob-text", ["--objective", "mlm", "--objective-arg", "mask_prob=abc"], "mask_prob='abc' must be a"),
    ("clm-padding-side", ["--objective-arg", "padding_side=middle"], "padding_side='middle' must be one of"),
    ("tokenizer-missing", ["--tokenizer", "{tmp}/missing.json"], "missing.json: no such file"),
    ("one-example-file", ["--objective", "seq2seq", "--data", "{tmp}/one.jsonl"],
     "one.jsonl: 1 example(s); a file split into train and validation needs at least 2"),
]


@pytest.mark.parametrize("args,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_train_input_is_one_line_and_writes_no_run(tmp_path, capsys, args, expect):
    (tmp_path / "one.jsonl").write_text(ONE_PAIR)
    out = tmp_path / "run"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["train", "--tokenizer", "byte", *TINY, "--max-steps", "1", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("seqlab train: error: ") and expect in err[0], err
    assert existing_run(out) is None  # nothing written: the corrected command is not refused as "holds a run"


def test_init_with_other_shapes_names_the_first_tensor(tmp_path, capsys):
    src = tmp_path / "src"
    assert main(["train", "--tokenizer", "byte", *TINY, "--max-steps", "1", "--out", str(src)]) == 0
    capsys.readouterr()
    assert main(["train", "--tokenizer", "byte", *TINY, "--max-steps", "1", "--out", str(tmp_path / "big"),
                 "--init", str(src), "--model", "d_model=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) < 400, err  # not torch's list of every mismatching tensor
    assert f"--init {src}: stack.embed.tok.weight has shape (" in err[0]
    assert "in this model; use the same --preset/--model settings and tokenizer" in err[0]


@pytest.mark.parametrize("source", ["run", "folder"])
def test_init_with_the_same_shapes_but_other_math_names_the_field(tmp_path, capsys, source):
    """Equal shapes, another rope base: the weights were copied and the model computed something else (logits off by
    4), silently. A run directory and a model folder (save_pretrained) are both compared."""
    src = tmp_path / "src"
    assert main(["train", "--tokenizer", "byte", *TINY, "--max-steps", "1", "--out", str(src),
                 "--model", "rope_base=500"]) == 0
    if source == "folder":
        save_pretrained(load_pretrained(src / "checkpoints" / "step_00000001"), tmp_path / "folder")
        src = tmp_path / "folder"
    capsys.readouterr()
    assert main(["train", "--tokenizer", "byte", *TINY, "--max-steps", "1", "--out", str(tmp_path / "other"),
                 "--init", str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--init {src}: its model has rope_base=500" in err[0]
    assert "but this run builds rope_base=10000.0" in err[0]
    assert main(["train", "--tokenizer", "byte", *TINY, "--max-steps", "1", "--out", str(tmp_path / "same"),
                 "--init", str(src), "--model", "rope_base=500"]) == 0


def test_a_run_recorded_before_document_bos_rebuilds_its_own_stream():
    """CLM streams gained a BOS before each document (2026-12-07). A run recorded before has no such field: eval
    and --resume must rebuild the stream it trained on (its window count is part of the resumed data position)."""
    old, new = TrainConfig.from_dict({"objective": "clm"}), TrainConfig(objective="clm")
    assert (old.document_bos, new.document_bos, TrainConfig.from_dict(new.to_dict()).document_bos) == (False, True, True)
    tok = ByteTokenizer()
    before = build_dataset("clm", None, tok, 64, "validation", **dataset_options(old))
    after = build_dataset("clm", None, tok, 64, "validation", **dataset_options(new))
    assert before[0][0] != tok.bos_id and after[0][0] == tok.bos_id
    assert after.info["n_tokens"] > before.info["n_tokens"]


def test_dpo_max_len_cuts_the_pairs_the_trainer_reads(tmp_path):
    """``--objective-arg max_len=N`` is honoured by the datasets the trainer and `seqlab eval` build (it was
    checked and recorded, then ignored), as ``DPO.tokenize`` honours it."""
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join('{"prompt": "Say hi %d please", "chosen": "Hi there %d", "rejected": "No"}\n' % (i, i)
                             for i in range(30)))
    tok = ByteTokenizer()
    cfg = TrainConfig(objective="dpo", data=str(prefs), seq_len=64, objective_kwargs={"max_len": 8})
    with pytest.warns(UserWarning, match="longer than a row of 8 tokens"):
        cut = build_datasets(cfg, tok)
    for split in cut:
        assert all(len(ex["prompt_ids"]) + len(ex["chosen_ids"]) <= 8 for ex in split)
    full, _ = build_datasets(cfg.replace(objective_kwargs={}), tok)
    assert max(len(ex["prompt_ids"]) + len(ex["chosen_ids"]) for ex in full) > 8


def test_init_under_another_tokenizer_of_the_same_size_is_refused(tmp_path, capsys):
    """`--tokenizer bpe:280` learned again on other text: same shapes, yet many ids stand for other tokens, and the
    --init weights were copied and trained on without a word (a walkthrough's SFT -> DPO with bpe:400 repeated)."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    b.write_text("lorem ipsum dolor sit amet consectetur adipiscing\n" * 60)
    src = tmp_path / "src"
    assert main(["train", "--tokenizer", "bpe:280", "--data", str(a), *TINY, "--max-steps", "1", "--out", str(src)]) == 0
    capsys.readouterr()
    args = ["train", *TINY, "--max-steps", "1", "--init", str(src)]
    assert main([*args, "--tokenizer", "bpe:280", "--data", str(b), "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its tokenizer" in err[0] and "gives ids to other tokens" in err[0]
    saved = src / "checkpoints" / "step_00000001" / "tokenizer.json"
    assert main([*args, "--tokenizer", str(saved), "--data", str(b), "--out", str(tmp_path / "same")]) == 0
