"""Packing documents into rows with document ids gives the same loss as one document per padded row."""

import pytest
import torch

from seqlab.data import build_dataset
from seqlab.data.byte_tokenizer import byte_backend
from seqlab.data.packing import PAD_DOCUMENT, pack_documents, packing_efficiency
from seqlab.data.tokenizer import Tokenizer
from seqlab.objectives import CausalLM, build_objective
from seqlab.objectives.clm import next_token_labels
from seqlab.objectives.loss import IGNORE_INDEX
from tests.objectives.helpers import TOK, tiny_model

DOCS = ["Is this a dagger which I see before me,", "The handle toward my hand?", "Come, let me clutch thee.",
        "I have thee not,", "and yet I see thee still.", "Art thou not, fatal vision, sensible",
        "To feeling as to sight?"]


def _docs():
    return [[TOK.bos_id] + TOK.encode(d) + [TOK.eos_id] for d in DOCS]


def test_pack_layout():
    docs = _docs()
    rows = pack_documents(docs, 64, TOK.pad_id)
    assert all(len(r["input_ids"]) == len(r["document_ids"]) == 64 for r in rows)
    assert len(rows) < len(docs)
    found = []
    for r in rows:
        ids, doc = r["input_ids"], r["document_ids"]
        k = 0
        while k < 64 and doc[k] != PAD_DOCUMENT:
            j = k
            while j < 64 and doc[j] == doc[k]:
                j += 1
            found.append(ids[k:j])
            k = j
        assert all(d == PAD_DOCUMENT for d in doc[k:]) and all(t == TOK.pad_id for t in ids[k:])
        assert [d for d in doc if d >= 0] == sorted(d for d in doc if d >= 0)  # ids count up within a row
    assert sorted(map(tuple, found)) == sorted(map(tuple, docs))  # every document exactly once, unsplit
    assert packing_efficiency(rows) == sum(map(len, docs)) / (64 * len(rows))
    long = pack_documents([list(range(150))], 64, 0)  # longer than a row: pieces that overlap by one token
    assert [sum(d >= 0 for d in r["document_ids"]) for r in long] == [64, 64, 24]
    batch = {k: torch.tensor([r[k] for r in long]) for k in ("input_ids", "document_ids")}
    targets = next_token_labels(batch["input_ids"], batch["document_ids"], batch["document_ids"] >= 0)
    # every token after the first is a target once; cut end to end, the two tokens after the cuts were lost
    assert sorted(targets[targets != IGNORE_INDEX].tolist()) == list(range(1, 150))


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_packed_loss_equals_unpacked(pos):
    model = tiny_model(pos=pos, seed=2)
    obj = CausalLM(TOK)
    docs = _docs()
    unpacked = obj.loss(model, obj.collate(docs))
    packed_batch = obj.collate(pack_documents(docs, 80, TOK.pad_id))
    assert packed_batch["input_ids"].shape[0] < len(docs)
    packed = obj.loss(model, packed_batch)
    assert packed.n_targets == unpacked.n_targets == sum(len(d) - 1 for d in docs)
    a, b = float(packed.loss_sum.detach()), float(unpacked.loss_sum.detach())
    assert abs(a - b) <= 1e-6 * abs(b)  # fp32 summation order only
    # without the document mask the rows would leak context across documents: the loss changes, by far more than
    # the 1e-6 that summation order allows (BOS targets are dropped either way, so this is the leak alone)
    leaky = dict(packed_batch)
    leaky.pop("document_ids")
    assert abs(float(obj.loss(model, leaky).loss_sum.detach()) - b) > 1e-5 * abs(b)


def test_a_tokenizer_without_pad_packs_and_each_document_opens_with_bos(tmp_path):
    """GPT-2's tokenizer has no pad and BOS is EOS: --pack crashed on the missing pad (TypeError). Each packed
    document is <|endoftext|> + text + <|endoftext|>: it sees nothing of the document before it, so without its own
    opener its first token was never a target (one per document lost, where the stream without --pack scores it)."""
    tok = Tokenizer.from_backend(byte_backend(["<|endoftext|>"]), name="gpt2like")
    assert tok.pad_id is None and tok.bos_id == tok.eos_id
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "doc {i}"}}\n' for i in range(30)))
    ds = build_dataset("clm", tmp_path / "docs.jsonl", tok, 32, "train", pack=True)
    batch = build_objective("clm", tok).collate([ds[i] for i in range(len(ds))])
    ids, docs = batch["input_ids"][0].tolist(), batch["document_ids"][0].tolist()
    eot = tok.eos_id
    assert ids[:16] == [eot, *b"doc 10", eot, eot, *b"doc 11", eot] and docs[:16] == [0] * 8 + [1] * 8
    targets = next_token_labels(batch["labels"], batch["document_ids"], batch["attention_mask"])
    real = batch["document_ids"][:, 1:] >= 0
    assert bool((targets[~real] == IGNORE_INDEX).all())
    n_docs = int(sum(len(set(d) - {PAD_DOCUMENT}) for d in batch["document_ids"].tolist()))
    assert int((targets == ord("d")).sum()) == n_docs  # each text's first byte, predicted from its opener


def test_mlm_rows_without_bos_or_eos(tmp_path):
    """A tokenizer with only <pad> and <mask> put None at both ends of every MLM row (a TypeError in collate)."""
    tok = Tokenizer.from_backend(byte_backend(["<pad>", "<mask>"]), name="nobos")
    (tmp_path / "t.txt").write_text("hello world, " * 40)
    ds = build_dataset("mlm", tmp_path / "t.txt", tok, 16, "train")
    assert len(ds[0]) == 16 and None not in ds[0]
    build_objective("mlm", tok).collate([ds[i] for i in range(len(ds))])
