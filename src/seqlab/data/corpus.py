"""The embedded default corpus: 20 Shakespeare plays, shipped inside the package (see ``corpus/NOTICE``).

The split is fixed and by whole play (19 train, Julius Caesar held out), so validation numbers measure text the
model has never seen and stay comparable across runs, machines and tokenizers.
"""

from __future__ import annotations

import json
import lzma
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

CORPUS_FILE = "shakespeare.json.xz"
SPLITS = ("train", "validation")
_ALIASES = {"val": "validation", "valid": "validation", "eval": "validation"}


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    split: str
    text: str


def normalise_split(split: str) -> str:
    split = _ALIASES.get(split, split)
    if split not in SPLITS:
        hint = "; there is no separate test split: the held-out data is 'validation'" if split == "test" else ""
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS} (or val/valid/eval){hint}")
    return split


@lru_cache(maxsize=1)
def _load_all() -> tuple[Document, ...]:
    raw = resources.files("seqlab.data").joinpath("corpus", CORPUS_FILE).read_bytes()
    payload = json.loads(lzma.decompress(raw))
    return tuple(Document(d["id"], d["title"], d["split"], d["text"]) for d in payload["documents"])


def load_documents(split: str = "train") -> list[Document]:
    """The plays of one split, in a fixed order."""
    split = normalise_split(split)
    return [d for d in _load_all() if d.split == split]


def load_corpus(split: str = "train") -> str:
    """All plays of a split as one string, separated by a blank line (each play ends with a newline)."""
    return "\n".join(d.text for d in load_documents(split))
