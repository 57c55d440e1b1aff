"""Packed (oneDNN) linear weights: same logits, same greedy tokens, nothing lost on save, no silent gradients."""
import copy

import pytest
import torch

from seqlab.accel import PackedLinear, is_packed, pack_for_inference, packing_available
from seqlab.generate import generate, generate_output
from seqlab.io import load_pretrained, save_pretrained

from .helpers import assert_same_greedy_tokens
from .helpers import tiny_model as _model

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN (mkldnn) support")
# packed and dense products differ by summation order only: fp32 logits agree to ~1e-6 relative on these sizes;
# greedy tokens are compared where the top-2 logit gap is 100x that tolerance (helpers.assert_same_greedy_tokens)
ATOL = 1e-5
MARGIN = 1e-3


@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_packed_model_matches_dense(tie, bias):
    model = _model(tie, bias)
    ids = torch.randint(0, 97, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with torch.no_grad():
        ref = model(ids, mask)
    plain_ref = _model(tie, bias)
    ref_tokens = generate(model, ids, mask, max_new_tokens=12)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_for_inference(model, rows_hint=3) == n_linear > 0
    assert is_packed(model) and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    with torch.no_grad():
        out = model(ids, mask)
    assert torch.allclose(out, ref, atol=ATOL, rtol=ATOL)
    got = generate(model, ids[1:], mask[1:], max_new_tokens=12)  # unpadded rows: the margin check's forward pass
    assert_same_greedy_tokens(plain_ref, ids.shape[1], ref_tokens[1:], got, MARGIN)
    if tie:  # the embedding keeps its dense table (lookups), the head its own packed copy
        assert isinstance(model.stack.embed.tok.weight, torch.nn.Parameter)


def test_repacking_for_another_row_count_keeps_the_weights():
    model = _model()
    x = torch.randn(8, 64)
    pack_for_inference(model, rows_hint=1)
    layer = model.lm_head.proj
    before = layer(x)
    assert pack_for_inference(model, rows_hint=8) > 0
    assert model.lm_head.proj.rows_hint == 8
    assert torch.allclose(model.lm_head.proj(x), before, atol=1e-6)
    assert pack_for_inference(model, rows_hint=8) == 0  # already packed for 8 rows: nothing to do


def test_a_copy_of_a_packed_model_is_independent():
    model = _model(tie=False, bias=True)
    pack_for_inference(model)
    clone = copy.deepcopy(model)
    a, b = model.stack.blocks[0].attn.qkv, clone.stack.blocks[0].attn.qkv
    assert a.handle != b.handle and a.packed is not b.packed
    assert a.bias.data_ptr() != b.bias.data_ptr()
    x = torch.randn(3, 64)
    assert torch.equal(a(x), b(x))
    with torch.no_grad():
        b.bias.add_(1.0)
    assert not torch.equal(a(x), b(x))


def test_state_dict_of_a_packed_model_is_dense_and_round_trips(tmp_path):
    dense = _model()
    packed = _model()
    pack_for_inference(packed)
    sd_dense, sd_packed = dense.state_dict(), packed.state_dict()
    assert sd_dense.keys() == sd_packed.keys()
    for k in sd_dense:
        assert torch.equal(sd_dense[k], sd_packed[k]), k
    save_pretrained(packed, tmp_path)
    reloaded = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids), dense(ids), atol=1e-6)
    # loading a state dict into a packed model repacks its layers
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    packed.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.allclose(packed(ids), other(ids), atol=1e-5)


def test_packed_layers_refuse_gradients():
    model = _model()
    pack_for_inference(model)
    model.train()
    ids = torch.randint(0, 97, (2, 5))
    with pytest.raises(RuntimeError, match="packed for inference"):
        model(ids)  # the embedding output requires grad: the first packed layer must refuse it
    with torch.no_grad():
        model(ids)  # inference is fine


def test_packing_skips_what_it_cannot_pack():
    model = _model().to(torch.float16)  # oneDNN packs fp32 and (where the CPU has it) bf16, not fp16
    assert pack_for_inference(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_packed_decode_step_compiles_to_the_same_tokens():
    """Under torch.compile a packed layer is an opaque custom op (oneDNN's packed tensors cannot be traced).

    Inductor generates its own code for everything around the products (its vector width follows the ISA), so the
    compiled logits equal the eager ones to rounding only: tokens are compared where the choice is decided.
    """
    model, plain = _model(), _model()
    ids = torch.randint(0, 97, (2, 6))
    pack_for_inference(model, rows_hint=2)
    eager = generate_output(model, ids, max_new_tokens=8, eos_token_id=[]).sequences
    compiled = generate_output(model, ids, max_new_tokens=8, eos_token_id=[], compile=True).sequences
    assert_same_greedy_tokens(plain, ids.shape[1], eager, compiled, MARGIN)
