"""Byte-level BPE trained on our own texts: deterministic, and cached by content hash.

The trained file is ``bpe-<vocab>-<sha16>.json`` in ``cache_dir`` (normally the run directory), so a resumed or
repeated run reuses exactly the same merges instead of retraining.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Iterator, Sequence

import tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from seqlab.data.tokenizer import BOS, EOS, MASK, PAD, SPECIAL_TOKENS, Tokenizer
from seqlab.runtime import progress
from seqlab.runtime.signals import GracefulStop

TOKENIZER_FORMAT_VERSION = 2  # bump when the BPE recipe changes, so cached files are not reused across recipes


def bpe_cache_key(texts: Sequence[str], vocab_size: int, specials: Sequence[str] = SPECIAL_TOKENS) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([TOKENIZER_FORMAT_VERSION, vocab_size, list(specials), tokenizers.__version__]).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8")).digest())
    return h.hexdigest()[:16]


def _with_progress(texts: Sequence[str], enabled: bool) -> Iterator[str]:
    """The texts as the trainer reads them, behind a progress bar (the merge phase itself runs in Rust)."""
    total = sum(len(t) for t in texts)
    with progress(total=total, desc="BPE training: reading", unit="char", unit_scale=True, enabled=enabled,
                  delay=2.0) as bar:
        for t in texts:
            yield t
            bar.update(len(t))


def train_bpe(texts: Sequence[str], vocab_size: int = 4096, cache_dir: str | os.PathLike | None = None,
              specials: Sequence[str] = SPECIAL_TOKENS, show_progress: bool = True) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation, no prefix space), specials at ids 0..len(specials)-1.

    With ``cache_dir`` the trained file is stored as ``bpe-<vocab>-<sha16>.json`` and reused when the texts, size,
    specials and ``tokenizers`` version hash to the same key.
    """
    if vocab_size < 256 + len(specials):
        raise ValueError(f"bpe vocab_size={vocab_size} must be >= 256 + {len(specials)} specials")
    cache_file = None
    if cache_dir is not None:
        cache_file = Path(cache_dir) / f"bpe-{vocab_size}-{bpe_cache_key(texts, vocab_size, specials)}.json"
        if cache_file.is_file():
            return Tokenizer.from_file(cache_file, pad=PAD, bos=BOS, eos=EOS, mask=MASK)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # <mask> takes the space before it (lstrip, as RoBERTa's): a masked word's token carries its own space ("Ġbe"),
    # so "to <mask>," must read as "to" + <mask> + ",", not with a lone "Ġ" that training never showed
    added = [AddedToken(s, special=True, normalized=False, lstrip=s == MASK) for s in specials]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2, show_progress=False,
    )
    # The trainer swallows a KeyboardInterrupt raised in the iterator it reads and trains on what it had: Ctrl-C was
    # lost (the run went on, exit 0) and a tokenizer of part of the texts was cached under the key of all of them.
    # So a signal here is held until the trainer returns, then raised.
    with GracefulStop(message="the tokenizer's training cannot be cut short: exiting when it ends") as stop:
        backend.train_from_iterator(_with_progress(list(texts), show_progress), trainer=trainer, length=len(texts))
    if stop.requested:
        raise KeyboardInterrupt(f"{signal.Signals(stop.signum).name} during the tokenizer's training")
    out = Tokenizer.from_backend(backend, name=f"bpe-{vocab_size}", pad=PAD, bos=BOS, eos=EOS, mask=MASK)
    if cache_file is not None:
        out.save(cache_file)
        out.name = str(cache_file)
    return out
