import pytest

from seqlab.runtime.rundir import RunDirectoryInUse, claim_run_dir, first_existing, move_aside


def test_a_run_is_refused_or_moved_aside_whole_and_never_deleted(tmp_path):
    out = tmp_path / "R"
    assert claim_run_dir(out, first_existing(out, ("log.jsonl",))) is None and out.is_dir()
    (out / "log.jsonl").write_text("old run")
    found = first_existing(out, ("absent", "log.jsonl"))
    assert found == out / "log.jsonl"
    with pytest.raises(RunDirectoryInUse, match=r"R: already holds a run \(.*log.jsonl\); use --resume"):
        claim_run_dir(out, found)
    moved = claim_run_dir(out, found, overwrite=True)
    assert moved.name.startswith("R.old-") and (moved / "log.jsonl").read_text() == "old run"
    assert out.is_dir() and not any(out.iterdir())
    (out / "log.jsonl").write_text("second run")
    again = move_aside(out)  # within the same second: the name gets a counter instead of replacing the first
    assert again != moved and again.name.startswith("R.old-") and (again / "log.jsonl").read_text() == "second run"
