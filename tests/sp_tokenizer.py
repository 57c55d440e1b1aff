"""A word-level tokenizer with SentencePiece's Metaspace pre-tokenizer and decoder (as Llama 2 and Mistral decode):
its decoder drops the space before a text's first word, which continuations must keep."""

from __future__ import annotations

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from seqlab.data.tokenizer import Tokenizer

WORDS = ["<unk>", "</s>", "▁To", "▁be", "▁or", "▁not", "▁to", "."]


def sentencepiece_words() -> Tokenizer:
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens(["</s>"])
    return Tokenizer.from_backend(backend, eos="</s>")
