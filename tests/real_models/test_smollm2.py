"""SmolLM2-135M-Instruct (packaged GGUF): seqlab vs Hugging Face transformers loading the same file.

Covers the tokenizer (encode/decode on awkward text), the chat template, fp32 logits and 64-token greedy
generation. The models are session fixtures (conftest.py), so the slow HF import happens once.
"""

from __future__ import annotations

import copy
import random
import unicodedata

import pytest
import torch

from seqlab.cli.packaged import SMOLLM2_CHATS
from seqlab.generate import generate
from tests.real_models.conftest import SMOLLM

pytestmark = [SMOLLM, pytest.mark.slow]

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tmore\ttabs, newlines\n\n\nand\r\nCRLF\n",
    "whitespace runs:          ten spaces, then\u00a0nbsp and\u3000ideographic space",
    "digits 0 12 345 6789 3.14159 -42 1e-10 0x1F 2024-11-30 1,234,567.89",
    "Unicode: naïve café résumé Straße ÆØÅ æøå",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤖🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "Ελληνικά русский язык עברית العربية हिन्दी",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # slow!\n",
    'for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  /* C */\n#include <stdio.h>',
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "I'm can't won't you'd they'll we've she's IT'S",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "combining: e\u0301 a\u0308 \u200bzero-width\u200d joiner",
    "",
    " ",
    "\n",
]

def _hf_ids(out):
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_config_from_gguf_metadata(smollm):
    model, tok = smollm
    c = model.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_ff) == ("decoder", 30, 576, 9, 3, 1536)
    assert (c.vocab_size, c.rope_base, c.pos, c.norm, c.mlp, c.tie_embeddings) == (49152, 1e5, "rope", "rmsnorm", "swiglu", True)
    assert model.lm_head.proj.weight is model.stack.embed.tok.weight
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert set(c.extra["gguf_tensor_types"]) == {"F32", "Q4_1", "Q8_0"}


def test_tokenizer_matches_hf(smollm, hf_smollm_tokenizer):
    _, tok = smollm
    hf = hf_smollm_tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text), repr(text)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids) == text, repr(text)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    # decoding arbitrary ids, including special tokens and byte tokens that split UTF-8 characters
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_non_ascii_numerals_are_isolated_like_llama_cpp(smollm, hf_smollm_tokenizer):
    """The file says ``tokenizer.ggml.pre = "smollm"``: every numeric character is its own pre-token (llama.cpp's
    regex ``\\p{N}`` first; the original tokenizer.json's ``Digits(individual_digits=True)``).

    HF's GGUF loader ignores that key. For ASCII digits this makes no difference (no merge in the vocabulary
    touches a digit, which the first test checks), but for other numerals (², ٣, ½) HF merges a preceding space
    into the numeral's bytes, which the model never saw in training. The expected ids here are HF's BPE applied
    to the pieces cut at each numeric character, i.e. llama.cpp's rule with HF's merges.
    """
    _, tok = smollm
    hf = hf_smollm_tokenizer
    assert not any(ch.isdigit() for m in tok.backend.get_vocab() if len(m) > 1 for ch in m if ch.isascii())
    for text in ("x² + y² = z²", "Arabic ٣٤٥ and Devanagari ४२", "half ½ and ⅓ and Ⅻ", "x 12 y"):
        pieces, cur = [], ""
        for ch in text:
            if unicodedata.numeric(ch, None) is not None:
                pieces += [cur, ch]
                cur = ""
            else:
                cur += ch
        pieces.append(cur)
        expected = [i for p in pieces if p for i in hf.encode(p)]
        assert tok.encode(text) == expected, text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_chat_template_matches_hf(smollm, hf_smollm_tokenizer):
    _, tok = smollm
    hf = hf_smollm_tokenizer
    odd = [{"role": "user", "content": "emoji 🤖 and\ttabs"}, {"role": "assistant", "content": "ok"}]
    for chat in [*SMOLLM2_CHATS, odd]:
        for agp in (False, True):
            assert tok.apply_chat_template(chat, add_generation_prompt=agp, tokenize=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=agp, tokenize=False)
            assert tok.apply_chat_template(chat, add_generation_prompt=agp) == \
                _hf_ids(hf.apply_chat_template(chat, add_generation_prompt=agp))


def test_model_matches_hf(smollm, hf_smollm, monkeypatch, capsys):
    """Everything that needs the HF model, in one test so that only one xdist worker pays for loading it.

    1. fp32 logits on 4 prompts, each alone and all as one left-padded batch: max abs diff < 1e-3.
    2. Greedy generation of 64 tokens on 5 chat prompts: HF generates each alone, seqlab all as one left-padded
       batch; identical up to and including EOS.
    3. ``seqlab chat --message ... --temperature 0`` prints exactly HF's greedy reply. The CLI accelerates the model
       (``seqlab.accel.accelerate``), so this is also the accelerated model's real-model check.
    """
    model, tok = smollm
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fib(n):\n    return", "1, 2, 3, 4,")]
    prompts.append(tok.apply_chat_template(SMOLLM2_CHATS[3], add_generation_prompt=True))
    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            ours, ref = model(x), hf_smollm(x).logits
            refs.append(ref[0])
            assert (ours - ref).abs().max().item() < 1e-3
        batch, mask = tok.pad(prompts, side="left")
        ours = model(batch, attention_mask=mask)
    for i, ids in enumerate(prompts):  # each row's real positions still match HF's unpadded run
        assert (ours[i, -len(ids):] - refs[i]).abs().max().item() < 1e-3

    eos = tok.eos_id
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in SMOLLM2_CHATS]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf_smollm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=64, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            new = out[0, len(ids):].tolist()
            expected.append(new[: new.index(eos) + 1] if eos in new else new)
    batch, mask = tok.pad(prompts, side="left")
    got = generate(model, batch, attention_mask=mask, max_new_tokens=64, eos_token_id=eos)[:, batch.shape[1]:]
    for row, exp in zip(got.tolist(), expected):
        assert row[: len(exp)] == exp, (tok.decode(row[: len(exp)]), tok.decode(exp))
    assert sum(len(e) == 64 for e in expected) >= 2  # most replies run the full 64 tokens: long comparisons

    import seqlab.cli.model_args as model_args
    from seqlab.cli import main

    # a copy: the CLI accelerates the model it loads in place, and the session fixture must stay a plain model
    loaded = copy.deepcopy(model)
    monkeypatch.setattr(model_args, "load_gguf", lambda path, dtype=torch.float32, device=None, quant=None: (loaded, tok))
    assert main(["chat", "--message", SMOLLM2_CHATS[0][0]["content"], "--temperature", "0", "--max-new-tokens", "64"]) == 0
    reply = capsys.readouterr().out
    assert loaded.accel_plan.for_ == "decode"  # the CLI accelerated the model it loaded (routes by calibration)
    assert reply == tok.decode([t for t in expected[0] if t != eos], skip_special_tokens=True).strip() + "\n"
    assert "Paris" in reply
