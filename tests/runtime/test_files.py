import stat

import pytest

from seqlab.accel import calibrate
from seqlab.runtime import native
from seqlab.runtime.files import atomic_path, atomic_write_bytes, cache_root, read_json_object


class BadDocument(Exception):
    pass


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_an_atomic_write_gets_the_mode_of_a_plain_open_not_mkstemps_private_one(tmp_path):
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"x")
    atomic_write_bytes(tmp_path / "a.bin", b"new")
    assert (tmp_path / "a.bin").read_bytes() == b"new"
    assert _mode(tmp_path / "a.bin") == _mode(plain)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "plain.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


@pytest.mark.parametrize("text, message", [
    (None, r"c\.json: file not found"),
    ('{"a": 1,\n "b": }', r"c\.json: line 2: not valid JSON \(Expecting value\)"),
    (b"\xff\xfe{}", r"c\.json: not valid JSON \(not UTF-8 text\)"),
    ("[1, 2]", r"c\.json: expected a JSON object, got list"),
])
def test_a_bad_json_file_is_one_error_of_the_callers_class_naming_the_file(tmp_path, text, message):
    path = tmp_path / "c.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(BadDocument, match=message):
        read_json_object(path, BadDocument)


def test_one_variable_moves_every_cache(monkeypatch, tmp_path):
    """$SEQLAB_CACHE holds the kernels and the calibration timings; $SEQLAB_ACCEL_CACHE still moves the timings
    alone; without either, $XDG_CACHE_HOME/seqlab, then ~/.cache/seqlab."""
    for var in ("SEQLAB_CACHE", "SEQLAB_ACCEL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == calibrate.cache_dir() == native.cache_dir() == tmp_path / "home" / ".cache" / "seqlab"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibrate.cache_dir() == native.cache_dir() == tmp_path / "xdg" / "seqlab"
    monkeypatch.setenv("SEQLAB_CACHE", str(tmp_path / "all"))
    assert calibrate.cache_dir() == native.cache_dir() == tmp_path / "all"
    monkeypatch.setenv("SEQLAB_ACCEL_CACHE", str(tmp_path / "timings"))
    assert calibrate.cache_dir() == tmp_path / "timings" and native.cache_dir() == tmp_path / "all"
