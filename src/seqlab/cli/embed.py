"""``seqlab embed``: sentence embeddings with a BERT-style encoder (default: packaged all-MiniLM-L6-v2).

    seqlab embed "first sentence" "second sentence" --cosine
    seqlab embed --file sentences.txt > vectors.jsonl

The pooling math is :func:`seqlab.eval.embeddings.sentence_embeddings`; this module finds and loads the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from seqlab.cli.model_args import source_kind, use_trained_special_rule
from seqlab.cli.packaged import MINILM_PACKAGE, missing_package, packaged_minilm
from seqlab.data import Tokenizer
from seqlab.data.readers import read_text_file
from seqlab.eval.embeddings import sentence_embeddings
from seqlab.io import load_pretrained, resolve_checkpoint
from seqlab.io.tensors import read_config_json
from seqlab.runtime.files import check_readable_file


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "embed", help="sentence embeddings (default: packaged all-MiniLM-L6-v2)",
        description="Mean-pooled, L2-normalised sentence embeddings from a BERT-style encoder (a Hugging Face folder, "
                    "or a seqlab encoder checkpoint such as an mlm run). "
                    "Prints one JSON object per line: {\"text\": ..., \"embedding\": [...]}.",
    )
    e.add_argument("texts", nargs="*", help="sentences to embed (or use --file, or stdin)")
    e.add_argument("--model", metavar="DIR", help="a BERT-like Hugging Face folder, or a seqlab encoder checkpoint "
                   f"or run directory (e.g. an mlm run; default: the model shipped by `{MINILM_PACKAGE}`)")
    e.add_argument("--file", metavar="PATH", help="read sentences from this file, one per line")
    e.add_argument("--max-length", type=int, default=None, help="truncate inputs to this many tokens "
                   "(default: sentence_bert_config.json's max_seq_length, else 512)")
    e.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    e.add_argument("--cosine", action="store_true", help="print the cosine-similarity matrix instead of the vectors")
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.add_argument("--debug", action="store_true", help="show tracebacks")
    e.set_defaults(func=run_embed)


def load_embedder(folder: str | Path | None = None):
    """(model, tokenizer, max_length) for a BERT-style HF folder or a seqlab encoder checkpoint (default: the
    packaged all-MiniLM-L6-v2)."""
    path = resolve_checkpoint(folder) if folder else packaged_minilm()
    if path is None:
        raise missing_package(MINILM_PACKAGE, "--model")
    model = load_pretrained(path)
    if model.config.arch != "encoder":
        raise ValueError(f"{path}: embeddings need an encoder (BERT-like) model, this is a {model.config.arch!r}")
    tokenizer = Tokenizer.from_pretrained(path)
    if source_kind(model) == "seqlab":  # trained here: its rows were [BOS] ... [EOS], as BERT's [CLS] ... [SEP]
        use_trained_special_rule(tokenizer, model.config.arch)
    max_length = model.config.max_seq_len
    st = path / "sentence_bert_config.json"
    if st.is_file():
        max_length = min(max_length, int(read_config_json(st).get("max_seq_length", max_length)))
    return model, tokenizer, max_length


def run_embed(args: argparse.Namespace) -> int:
    texts = list(args.texts)
    if args.file:
        text = read_text_file(check_readable_file(args.file, "--file"))  # (not UTF-8: named with its line)
        texts += [line for line in text.splitlines() if line.strip()]
    if not texts and not sys.stdin.isatty():
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise ValueError("no sentences: pass them as arguments, with --file, or on stdin")
    if args.max_length is not None and args.max_length < 2:
        raise ValueError(f"--max-length must be >= 2 (the [CLS] and [SEP] tokens), got {args.max_length}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    model, tokenizer, max_length = load_embedder(args.model)
    if args.max_length is not None and args.max_length > model.config.max_seq_len:
        raise ValueError(f"--max-length {args.max_length} exceeds the model's context ({model.config.max_seq_len} "
                         "positions)")
    emb = sentence_embeddings(model, tokenizer, texts, max_length=max_length if args.max_length is None else args.max_length,
                              batch_size=args.batch_size, show_progress=not args.no_progress)
    if args.cosine:
        sim = emb @ emb.T
        for i, t in enumerate(texts):
            print("\t".join(f"{v:.4f}" for v in sim[i].tolist()) + f"\t{t}")
        return 0
    for t, v in zip(texts, emb.tolist()):
        print(json.dumps({"text": t, "embedding": [round(x, 7) for x in v]}, ensure_ascii=False))
    return 0
