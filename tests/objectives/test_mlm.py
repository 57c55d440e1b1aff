"""Masked LM: 15 % of eligible tokens, 80/10/10, never PAD or special, seeded and resumable."""

import torch

from seqlab.objectives import IGNORE_INDEX, MaskedLM
from seqlab.objectives import mlm as mlm_module
from seqlab.objectives.mlm import MASKED, RANDOM, UNCHANGED
from tests.objectives.helpers import TOK, tiny_model


def _rows(n=400, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        L = int(torch.randint(20, 120, (1,), generator=g))
        body = torch.randint(0, 256, (L,), generator=g).tolist()
        body[L // 2] = TOK.token_id("<|im_end|>")  # a special inside the text: never eligible
        rows.append([TOK.bos_id] + body + [TOK.eos_id])
    return rows


def test_masking_statistics_and_never_special():
    obj = MaskedLM(TOK, seed=123)
    rows = _rows()
    counts = dict(eligible=0, picked=0, masked=0, random=0, unchanged=0)
    for i in range(0, len(rows), 50):
        chunk = rows[i: i + 50]
        ids_ref = obj.collate  # the public path: collate draws the mask
        batch = ids_ref(chunk)
        orig = torch.full_like(batch["input_ids"], TOK.pad_id)
        for r, s in enumerate(chunk):
            orig[r, : len(s)] = torch.tensor(s)
        special = torch.isin(orig, torch.tensor(sorted(TOK.special_ids)))
        picked = batch["labels"] != IGNORE_INDEX
        assert not (picked & special).any(), "a PAD/special token was picked"
        assert (batch["labels"][picked] == orig[picked]).all(), "labels must be the original tokens"
        assert (batch["input_ids"][~picked] == orig[~picked]).all(), "unpicked tokens must be untouched"
        inp = batch["input_ids"][picked]
        assert not torch.isin(inp[inp != TOK.mask_id], torch.tensor(sorted(TOK.special_ids))).any(), \
            "a random replacement was a special token"
        counts["eligible"] += int((~special).sum())
        counts["picked"] += int(picked.sum())
        counts["masked"] += int((inp == TOK.mask_id).sum())
        same = inp == orig[picked]
        counts["unchanged"] += int(same.sum())
        counts["random"] += int(((inp != TOK.mask_id) & ~same).sum())
    p = counts["picked"]
    assert p > 3000
    assert abs(counts["picked"] / counts["eligible"] - 0.15) < 0.01
    assert abs(counts["masked"] / p - 0.80) < 0.02
    # a random draw equals the original with probability 1/256, which moves ~0.04 % from "random" to "unchanged"
    assert abs(counts["random"] / p - 0.10) < 0.015
    assert abs(counts["unchanged"] / p - 0.10) < 0.015


def test_decision_codes_match_rates_exactly_by_category():
    from seqlab.objectives.mlm import mask_tokens

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (200, 200), generator=g)
    eligible = torch.ones_like(ids, dtype=torch.bool)
    eligible[:, :10] = False
    out, labels, dec = mask_tokens(ids, eligible, TOK.mask_id, torch.arange(256), g)
    assert (dec[:, :10] == 0).all()
    n = (dec > 0).sum().item()
    for code, rate in ((MASKED, 0.8), (RANDOM, 0.1), (UNCHANGED, 0.1)):
        assert abs((dec == code).sum().item() / n - rate) < 0.02
    assert (out[dec == MASKED] == TOK.mask_id).all()
    assert (out[dec == UNCHANGED] == ids[dec == UNCHANGED]).all()


def test_seeded_and_resumable():
    rows = _rows(8)
    a, b = MaskedLM(TOK, seed=7), MaskedLM(TOK, seed=7)
    first = [a.collate(rows) for _ in range(3)]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, [b.collate(rows) for _ in range(3)]))
    assert not torch.equal(first[0]["labels"], first[1]["labels"]), "a fresh mask per batch (dynamic masking)"
    c = MaskedLM(TOK, seed=7)
    c.load_state_dict({"calls": 2})
    assert torch.equal(c.collate(rows)["input_ids"], first[2]["input_ids"])
    assert a.state_dict() == {"calls": 3}


def test_loss_only_at_picked_positions():
    model = tiny_model("encoder")
    obj = MaskedLM(TOK, seed=0)
    batch = obj.collate(_rows(4))
    out = obj.loss(model, batch)
    assert out.n_targets == obj.num_targets(batch) == int((batch["labels"] != IGNORE_INDEX).sum())
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    picked = batch["labels"] != IGNORE_INDEX
    manual = torch.nn.functional.cross_entropy(logits[picked], batch["labels"][picked], reduction="sum")
    assert abs(float(out.loss_sum.detach()) - float(manual.detach())) < 1e-4


def test_evaluation_masks_repeat_and_leave_training_stream_alone():
    rows = _rows(6)
    obj, ref = MaskedLM(TOK, seed=5), MaskedLM(TOK, seed=5)
    first = obj.collate(rows)
    with obj.evaluating():
        e1 = obj.collate(rows)
    with obj.evaluating():
        e2 = obj.collate(rows)
    assert torch.equal(e1["input_ids"], e2["input_ids"])
    ref.collate(rows)
    assert torch.equal(obj.collate(rows)["input_ids"], ref.collate(rows)["input_ids"])
    assert not torch.equal(first["labels"], e1["labels"])


def test_ranks_mask_their_own_positions_and_evaluation_masks_follow_the_batch_index(monkeypatch):
    """Under torchrun every rank drew the same mask stream (the same positions of every batch), and a rank scoring
    batches 1 and 3 of an evaluation masked them as a single process masks batches 0 and 1: the validation loss
    depended on the number of processes."""
    batches = [_rows(4, seed=k) for k in range(4)]
    single = MaskedLM(TOK)
    with single.evaluating():
        expected = [single.collate(b)["input_ids"] for b in batches]
    drawn = {}
    for rank in (0, 1):
        monkeypatch.setattr(mlm_module.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(mlm_module.dist, "get_rank", lambda rank=rank: rank)
        obj = MaskedLM(TOK)
        drawn[rank] = obj.collate(batches[0])["input_ids"]
        with obj.evaluating():
            for k in range(rank, 4, 2):  # this rank's share of the evaluation
                obj.at_batch(k)
                assert torch.equal(obj.collate(batches[k])["input_ids"], expected[k])
    assert not torch.equal(drawn[0], drawn[1])
