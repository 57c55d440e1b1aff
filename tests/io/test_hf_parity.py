"""Hugging Face transformers as the oracle: the same random weights give the same logits in seqlab.

Every HF parameter (norm weights and biases included) is perturbed away from its initial value so that a wrong
mapping of any tensor shows up in the logits.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqlab.generate import generate  # noqa: E402
from seqlab.io import CheckpointError, load_hf, load_pretrained, save_pretrained  # noqa: E402
from seqlab.io.export_hf import export_hf  # noqa: E402

TOL = 1e-4


def _randomise(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _save(model, tmp_path):
    model.save_pretrained(tmp_path)
    return tmp_path


def _left_padded(vocab: int):
    ids = torch.randint(3, vocab, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    ids[mask == 0] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, pos


def _right_padded(vocab: int, T: int = 11):
    ids = torch.randint(3, vocab, (3, T))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    mask[2, -2:] = 0
    ids[mask == 0] = 1
    return ids, mask


def _close(ours, theirs, mask):
    real = mask.bool()
    diff = (ours[real] - theirs[real]).abs().max().item()
    print(f"PARITY max|diff| = {diff:.2e}")
    assert diff < TOL, diff
    return diff


def test_gpt2(tmp_path):
    hf = _randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager")))
    ours = load_hf(_save(hf, tmp_path))
    ids, mask, pos = _left_padded(101)
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask), hf(ids, attention_mask=mask, position_ids=pos).logits, mask)


def test_llama_gqa(tmp_path):
    hf = _randomise(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, tie_word_embeddings=False,
        attn_implementation="eager")))
    ours = load_hf(_save(hf, tmp_path))
    assert ours.config.n_kv_heads == 2 and ours.config.rope_base == 5000.0
    ids, mask, pos = _left_padded(101)
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask), hf(ids, attention_mask=mask, position_ids=pos).logits, mask)


def test_bert_mlm(tmp_path):
    hf = _randomise(transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, attn_implementation="eager")))
    ours = load_hf(_save(hf, tmp_path))
    ids, mask = _right_padded(101)
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask), hf(ids, attention_mask=mask).logits, mask)


def test_causal_bert_decoder_is_refused_by_name(tmp_path):
    """BertLMHeadModel (is_decoder) has BertForMaskedLM's tensor names: loaded as the encoder, its logits were off
    by 3.7, silently."""
    hf = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, is_decoder=True))
    with pytest.raises(CheckpointError, match="is_decoder=true"):
        load_hf(_save(hf, tmp_path))


def test_bart(tmp_path):
    hf = _randomise(transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=101, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=32,
        attn_implementation="eager")))
    with torch.no_grad():
        hf.final_logits_bias.normal_()
    ours = load_hf(_save(hf, tmp_path))
    src, src_mask = _right_padded(101)
    dec, dec_mask = _right_padded(101, T=7)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask).logits
        mine = ours(src, attention_mask=src_mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    _close(mine, theirs, dec_mask)


@pytest.mark.parametrize("option", [{"scale_attn_by_inverse_layer_idx": True}, {"scale_attn_weights": False}])
def test_gpt2_attention_scalings_seqlab_lacks_are_refused(tmp_path, option):
    """Either option changes every attention score (5e-3 and 8e-2 in the logits): refused by name, not ignored."""
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=64, n_layer=2,
                                                              n_head=4, **option))
    with pytest.raises(CheckpointError, match=f"GPT-2 {next(iter(option))}="):
        load_hf(_save(hf, tmp_path))


def test_gpt2_and_bert_keep_pad_ids_silu_and_untied_heads(tmp_path):
    """A GPT-2 with silu and a pad id, and an untied BERT (whose head adds cls.predictions.decoder.bias, no longer
    the same tensor as cls.predictions.bias in transformers 5), load to HF's logits and export back to them."""
    gpt2 = _randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, activation_function="silu", pad_token_id=3)))
    bert = _randomise(transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, hidden_act="silu", tie_word_embeddings=False)))
    for name, hf in (("gpt2", gpt2), ("bert", bert)):
        ours = load_hf(_save(hf, tmp_path / name))
        ids, mask = _right_padded(101)
        with torch.no_grad():
            _close(ours(ids, attention_mask=mask), hf(ids, attention_mask=mask).logits, mask)
        again = getattr(transformers, type(hf).__name__).from_pretrained(export_hf(ours, tmp_path / f"{name}-out"))
        with torch.no_grad():
            _close(ours(ids, attention_mask=mask), again.eval()(ids, attention_mask=mask).logits, mask)
        assert load_hf(tmp_path / f"{name}-out").config == ours.config
    assert load_hf(tmp_path / "gpt2").config.pad_token_id == 3


def test_bart_with_untied_token_tables_is_refused(tmp_path):
    """seqlab's encoder-decoder shares one token table; a BART whose encoder, decoder or head tables differ from it
    (tie_word_embeddings false) is refused, not loaded on the shared one alone (logits off by 1.8)."""
    hf = _randomise(transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=101, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=32,
        tie_word_embeddings=False)))
    with pytest.raises(CheckpointError, match="differs from model.shared.weight"):
        load_hf(_save(hf, tmp_path))


def test_every_listed_eos_ends_generation_as_in_hf(tmp_path):
    """A config listing several EOS ids (Llama 3's end of text, of a message, of a turn): greedy generation stops
    at any of them, token for token as HF's does (it ran past all but the first), and an export lists them all."""
    torch.manual_seed(0)
    hf = _randomise(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=41, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        bos_token_id=1, eos_token_id=[2, 5], pad_token_id=0)))
    with torch.no_grad():
        hf.lm_head.weight[5] += 0.5  # a likely token: some rows end on it
    ours = load_hf(_save(hf, tmp_path / "in"))
    ids = torch.randint(6, 41, (4, 5))
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=12, do_sample=False)
    mine = generate(ours, ids, max_new_tokens=12)
    assert (theirs[:, 5:] == 5).any() and torch.equal(mine, theirs)
    out = export_hf(ours, tmp_path / "out")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 5]


def test_save_load_round_trip(tmp_path):
    hf = _randomise(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=True)))
    ours = load_hf(_save(hf, tmp_path / "hf"))
    save_pretrained(ours, tmp_path / "ours")
    again = load_pretrained(tmp_path / "ours")
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        assert torch.equal(ours(ids), again(ids))
    assert again.lm_head.proj.weight is again.stack.embed.tok.weight  # still tied after the round trip


def test_unknown_tensors_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    _save(hf, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["transformer.h.0.mystery.weight"] = torch.zeros(2)
    del tensors["transformer.ln_f.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="ln_f.bias"):
        load_hf(tmp_path)
    tensors["transformer.ln_f.bias"] = torch.zeros(32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mystery"):
        load_hf(tmp_path)


def test_corrupted_checkpoint_is_refused(tmp_path):
    from seqlab import ModelConfig, build_model

    save_pretrained(build_model(ModelConfig(n_layers=1, d_model=32, n_heads=2)), tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("strategy", [{}, {"num_beams": 2}, {"do_sample": True, "top_k": 1}])
def test_a_batch_padded_past_the_position_table_generates_as_hf_does(tmp_path, strategy):
    """Prompts padded to a fixed width of 30 (5 and 3 real tokens) on a GPT-2 of 32 positions: HF generates 8
    tokens, and seqlab refused ("38 positions exceed the learned position table"), counting padded slots as
    positions; speculative decoding already counted each row's real tokens."""
    hf = _randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)))
    ours = load_hf(_save(hf, tmp_path))
    ids, mask = torch.zeros(2, 30, dtype=torch.long), torch.zeros(2, 30, dtype=torch.long)
    ids[0, -5:], ids[1, -3:] = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([10, 11, 12])
    mask[0, -5:], mask[1, -3:] = 1, 1
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             num_beams=strategy.get("num_beams", 1))
    mine = generate(ours, ids, mask, max_new_tokens=8, eos_token_id=[], **strategy)
    assert mine[:, 30:].tolist() == theirs[:, 30:].tolist()
