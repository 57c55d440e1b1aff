"""Data: tokenizers, the embedded corpus, file readers, synthetic tasks, collators and packing.

    tok = build_tokenizer("byte" | "bpe" | "bpe:4096" | "path/to/tokenizer.json", cache_dir=run_dir)
    ds = build_dataset("clm" | "mlm" | "seq2seq" | "sft" | "dpo", path_or_None, tok, seq_len, split, seed)
    text = load_corpus("train" | "validation")
"""

from seqlab.data.corpus import load_corpus, load_documents
from seqlab.data.datasets import Examples, build_dataset
from seqlab.data.readers import DataError
from seqlab.data.tokenizers import (ByteTokenizer, Tokenizer, TokenizerError, build_tokenizer, load_tokenizer,
                                    train_bpe)

__all__ = ["ByteTokenizer", "DataError", "Examples", "Tokenizer", "TokenizerError", "build_dataset",
           "build_tokenizer", "load_corpus", "load_documents", "load_tokenizer", "train_bpe"]
