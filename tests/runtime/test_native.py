"""seqlab's optional C libraries: a build that fails is None (callers run torch's ops), warned about only for AVX2."""
import warnings

import pytest

from seqlab.runtime import native


def test_a_library_that_cannot_be_built_is_none_and_only_the_avx2_failure_warns(monkeypatch, tmp_path):
    def broken(name, source, isa, includes=()):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(native, "build_library", broken)
    monkeypatch.setattr(native, "_OPTIONAL", {})
    with pytest.warns(RuntimeWarning, match="the test kernel unavailable .no compiler."):
        assert native.optional_library("t", tmp_path / "t.c", "avx2", feature="the test kernel") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.optional_library("t", tmp_path / "t.c", "avx512", feature="the test kernel") is None
        assert native.optional_library("t", tmp_path / "t.c", "avx2", feature="the test kernel") is None  # cached
    assert native.runnable_isas(lambda isa: native.optional_library("t", tmp_path / "t.c", isa)) == []


def test_a_built_library_gets_its_signatures_once(monkeypatch, tmp_path):
    built, signed = [], []
    monkeypatch.setattr(native, "build_library", lambda name, source, isa, includes=(): built.append(isa) or object())
    monkeypatch.setattr(native, "_OPTIONAL", {})
    for _ in range(2):
        assert native.optional_library("t", tmp_path / "t.c", "avx2", signatures=signed.append) is not None
    assert built == ["avx2"] and len(signed) == 1
