"""all-MiniLM-L6-v2 (packaged HF folder): seqlab's encoder + mean pooling vs HF BertModel + mean pooling.

A padded batch of sentences of very different lengths is the real-model check of the encoder's padding mask:
if padding leaked into attention or into the mean, short sentences would drift from their unpadded embeddings.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from seqlab.cli.embed import load_embedder
from seqlab.eval.embeddings import sentence_embeddings
from tests.real_models.conftest import MINILM

pytestmark = [MINILM]

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Hi",
    "A very long sentence about transformers, attention masks, padding tokens, and mean pooling that goes on "
    "for quite a while so that the other rows in the batch need plenty of padding. " * 3,
    "Unicode: naïve café 日本語 🤖",
]


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    return load_embedder(minilm_dir)


@pytest.fixture(scope="module")
def hf_bert(minilm_dir):
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    return AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(minilm_dir)


def _hf_embed(model, tok, texts, max_length):
    enc = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((h * m).sum(1) / m.sum(1), dim=1), enc


def test_tokenizer_matches_hf(embedder, hf_bert):
    _, tok, max_length = embedder
    _, hf_tok = hf_bert
    assert max_length == 256  # sentence_bert_config.json
    for s in SENTENCES:
        assert tok.encode(s, add_special_tokens=True) == hf_tok(s)["input_ids"], s


def test_padded_batch_embeddings_match_hf(embedder, hf_bert):
    model, tok, max_length = embedder
    hf_model, hf_tok = hf_bert
    ref, enc = _hf_embed(hf_model, hf_tok, SENTENCES, max_length)
    assert (enc["attention_mask"] == 0).any()  # the batch really is padded
    ours = sentence_embeddings(model, tok, SENTENCES, max_length=max_length, batch_size=len(SENTENCES))
    assert ours.shape == (len(SENTENCES), 384)
    assert (ours - ref).abs().max().item() < 1e-5
    # and each sentence alone (no padding) gives the same vector as in the padded batch
    alone = torch.cat([sentence_embeddings(model, tok, [s], max_length=max_length) for s in SENTENCES])
    assert (alone - ours).abs().max().item() < 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-6)


def test_truncation_matches_hf(embedder, hf_bert):
    model, tok, _ = embedder
    hf_model, hf_tok = hf_bert
    texts = [SENTENCES[4] * 3, SENTENCES[0]]
    ref, enc = _hf_embed(hf_model, hf_tok, texts, 64)
    assert enc["attention_mask"].sum(1).tolist()[0] == 64
    ours = sentence_embeddings(model, tok, texts, max_length=64)
    assert (ours - ref).abs().max().item() < 1e-5


def test_embed_cli(minilm_dir, capsys):
    from seqlab.cli import main

    assert main(["embed", "--model", str(minilm_dir), SENTENCES[0], SENTENCES[1], SENTENCES[2]]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == SENTENCES[:3]
    v = torch.tensor([r["embedding"] for r in rows])
    sim = v @ v.T
    # paraphrases are closer than unrelated sentences (the well-known all-MiniLM-L6-v2 example: ~0.755 vs ~-0.1)
    assert sim[0, 1] > 0.7 and sim[0, 2] < 0.1
    assert main(["embed", "--model", str(minilm_dir), "--cosine", "a cat", "a cat"]) == 0
    first = capsys.readouterr().out.splitlines()[0].split("\t")
    assert float(first[0]) == pytest.approx(1.0, abs=1e-4) and float(first[1]) == pytest.approx(1.0, abs=1e-4)


def test_quantised_minilm_embeds_like_the_float_one(minilm_dir, embedder, tmp_path, capsys):
    """`seqlab quantize` writes a MiniLM folder that `seqlab embed --model` reads; int8 groups of 32 keep every
    sentence's vector within cosine 0.99 of the float model's (measured: above 0.999)."""
    from seqlab.cli import main

    assert main(["quantize", "--checkpoint", str(minilm_dir), "--bits", "8", "--out", str(tmp_path / "q8")]) == 0
    capsys.readouterr()
    assert main(["embed", "--model", str(tmp_path / "q8"), *SENTENCES[:4]]) == 0
    quantised = torch.tensor([json.loads(line)["embedding"] for line in capsys.readouterr().out.splitlines()])
    model, tok, max_length = embedder
    ref = sentence_embeddings(model, tok, SENTENCES[:4], max_length=max_length)
    cos = (quantised * ref).sum(1)
    assert cos.min() > 0.99 and not torch.allclose(quantised, ref, atol=1e-6)


def test_a_bare_bert_exports_as_the_encoder_it_is(minilm_dir, embedder, tmp_path, capsys):
    """MiniLM has no MLM head; `seqlab export --format hf` writes it as the BertModel it came as (no random
    cls.* weights posing as a fill-mask head), which transformers and seqlab both read back to the same vectors."""
    from safetensors import safe_open
    from transformers import AutoModel

    from seqlab.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(minilm_dir), "--format", "hf", "--out", str(out)]) == 0
    assert "no MLM head" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    with safe_open(minilm_dir / "model.safetensors", "pt") as f:  # all but its pooler (seqlab pools by the mean)
        assert names == set(f.keys()) - {"pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids"}
    model, tok, max_length = embedder
    ref = sentence_embeddings(model, tok, SENTENCES[:3], max_length=max_length)
    again = sentence_embeddings(*load_embedder(out)[:2], SENTENCES[:3], max_length=max_length)
    torch.testing.assert_close(again, ref, rtol=0, atol=1e-6)
    # the sentence length MiniLM was trained to travels too (without it `seqlab embed` cut at 512, not 256)
    assert load_embedder(out)[2] == max_length == 256
    hf = AutoModel.from_pretrained(out).eval()
    batch = tok.pad([tok.encode(SENTENCES[0], add_special_tokens=True)])
    with torch.no_grad():
        hidden = hf(input_ids=batch[0], attention_mask=batch[1]).last_hidden_state
    pooled = F.normalize(hidden.mean(1), dim=-1)[0]
    torch.testing.assert_close(pooled, ref[0], rtol=0, atol=1e-5)
    # its tokenizer still gives sentence pairs their segments (transformers dropped token_type_ids without the name)
    from transformers import AutoTokenizer

    pair = AutoTokenizer.from_pretrained(out)("hi", "there")
    assert pair == AutoTokenizer.from_pretrained(minilm_dir)("hi", "there")
    assert pair["token_type_ids"] == [0, 0, 0, 1, 1]
