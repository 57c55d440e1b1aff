import torch

from seqlab.model import masks


def test_positions_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = masks.positions_from_mask(mask)
    assert pos[0, 2:].tolist() == [0, 1, 2]
    assert pos[1].tolist() == [0, 1, 2, 3, 4]


def test_document_mask_and_positions():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = masks.document_mask(docs)[0, 0]
    assert m[3].tolist() == [False, False, True, True, False, False]
    assert masks.positions_from_documents(docs)[0, :5].tolist() == [0, 1, 0, 1, 2]


def test_fully_masked_rows_become_attendable():
    m = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    m[0, 0, 1, 0] = True
    out = masks.ensure_attendable(m)
    assert out[0, 0, 0].all() and out[0, 0, 1].tolist() == [True, False, False]
