"""``seqlab generate``: loads a checkpoint + tokenizer, every strategy, streaming, clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from gen_helpers import assert_same_tokens_up_to_ties, decoder_oracle, tiny_decoder, tiny_encdec

from seqlab.cli import main
from seqlab.data.tokenizers import ByteTokenizer
from seqlab.generate import generate
from seqlab.io import save_pretrained


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    tok = ByteTokenizer()
    model = tiny_decoder(seed=40, vocab_size=tok.vocab_size, max_seq_len=32, pad_token_id=tok.pad_id,
                         bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    save_pretrained(model, d)
    tok.save(d / "tokenizer.json")
    return d, model, tok


def test_generate_greedy_matches_the_library(ckpt, tmp_path, capsys):
    d, model, tok = ckpt
    out_json = tmp_path / "new" / "out.json"  # a missing folder is made, as by eval --json and perplexity --json
    rc = main(["generate", "--checkpoint", str(d), "--prompt", "hello", "--prompt", "a", "--max-new-tokens", "6",
               "--json", str(out_json), "--metrics"])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    ids = [tok.bos_id] + tok.encode("hello")
    ref = generate(model, torch.tensor([ids]), max_new_tokens=6, eos_token_id=tok.eos_id)
    got = torch.tensor([doc["sequences"][0][: ref.shape[1]]])  # the CLI packs the weights: other kernels
    assert_same_tokens_up_to_ties(got, ref, len(ids), decoder_oracle(model, torch.tensor([ids])))
    assert doc["metrics"]["ttft_s"] > 0 and doc["metrics"]["kv_cache_bytes"] > 0
    assert "ttft" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--strategy", "sample", "--top-p", "0.9", "--seed", "3"],
                                   ["--num-beams", "3"],
                                   ["--draft", "SELF", "--num-speculative-tokens", "2"],
                                   ["--stream"]])
def test_strategies_and_stream_run(ckpt, capsys, extra):
    d, _, _ = ckpt
    extra = [str(d) if x == "SELF" else x for x in extra]
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "4", *extra]) == 0
    assert capsys.readouterr().out.strip()


def test_over_long_prompt_is_a_clear_error(ckpt, capsys):
    d, _, _ = ckpt
    assert main(["generate", "--checkpoint", str(d), "--prompt", "x" * 40, "--max-new-tokens", "2"]) == 2
    assert "exceeds the model's context (ModelConfig.max_seq_len=32)" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(d), "--prompt", "x" * 40, "--max-new-tokens", "2",
                 "--truncate"]) == 0
    assert main(["generate", "--checkpoint", str(d), "--prompt", "x", "--top-p", "0"]) == 2
    assert "GenerationConfig.top_p must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(d), "--prompt", "x" * 40, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "command line: --truncate" in err and "max_new_tokens" not in err  # the prompt alone is too long


def test_generating_past_the_context_warns(ckpt, capsys):
    """Rotary positions go on past max_seq_len (32 here): allowed, but said, since the model never saw them."""
    d, model, _ = ckpt
    assert model.config.pos != "learned"
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "40"]) == 0
    assert "runs past the model's context of 32 tokens" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "8"]) == 0
    assert "runs past" not in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(d), "--prompt", "x" * 40, "--max-new-tokens", "8", "--truncate"]) == 0
    assert "the prompt (32 tokens) + --max-new-tokens 8 runs past" in capsys.readouterr().err


def test_truncate_keeps_the_generated_text(ckpt, tmp_path, capsys):
    """The model reads only the last tokens, but the output (stdout, JSON) still holds the new text."""
    d, model, tok = ckpt
    prompt = "the quick brown fox jumps over the lazy dog"  # 43 bytes + BOS > max_seq_len=32
    out_json = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", str(d), "--prompt", prompt, "--max-new-tokens", "5", "--truncate",
                 "--json", str(out_json), "--no-pack"]) == 0
    ids = torch.tensor([[tok.bos_id] + tok.encode(prompt)])
    ref = generate(model, ids, max_new_tokens=5, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                   truncate_prompt=True)
    new = ref[0, ids.shape[1]:].tolist()
    assert new and ref.shape[1] == ids.shape[1] + len(new)
    text = tok.decode(new)
    doc = json.loads(out_json.read_text())
    assert doc["outputs"] == [text] and doc["sequences"] == ref.tolist()
    assert capsys.readouterr().out == f"{prompt}{text}\n"


def test_zero_beams_is_an_error_not_greedy(ckpt, capsys):
    d, _, _ = ckpt
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--num-beams", "0"]) == 2
    assert capsys.readouterr().err.strip() == "seqlab generate: error: --num-beams must be >= 1 (got 0)"


def test_stream_prints_what_the_plain_command_prints(ckpt, capsys):
    """--stream shows the prompt, then the continuation as it comes: the same text as without --stream."""
    d, _, _ = ckpt
    args = ["generate", "--checkpoint", str(d), "--prompt", "To be", "--max-new-tokens", "6", "--no-pack"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == plain and plain.startswith("To be")


def test_any_temperature_given_samples_one_included(ckpt, capsys):
    """``--temperature 1.0`` asks for sampling at T=1, as ``--temperature 0.99`` does; it read as "not set"."""
    d, _, _ = ckpt
    args = ["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "4", "--metrics", "--no-pack"]
    assert main(args) == 0 and "greedy:" in capsys.readouterr().err
    assert main([*args, "--temperature", "1.0", "--seed", "5"]) == 0 and "sample:" in capsys.readouterr().err


def test_a_draft_alone_keeps_greedy_decoding(ckpt, capsys):
    """Speculative decoding is a speed-up: with no sampling knob its text is greedy's (the draft is the model)."""
    d, _, _ = ckpt
    args = ["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "8", "--no-pack"]
    assert main(args) == 0
    greedy = capsys.readouterr().out
    for seed in ("1", "2"):
        assert main([*args, "--draft", str(d), "--seed", seed]) == 0
        assert capsys.readouterr().out == greedy


@pytest.mark.parametrize("extra, message", [
    (["--strategy", "beam", "--num-beams", "1"], "--strategy beam with --num-beams 1 is greedy search"),
    (["--num-beams", "2", "--draft", "SELF"], "--num-beams 2 needs beam search, not --strategy speculative"),
    (["--num-beams", "2", "--temperature", "0.7"], "beam search is deterministic here"),
    (["--num-beams", "2", "--stop", "x"], "beam search does not stop at --stop strings"),
    (["--num-beams", "2", "--stream"], "beam search settles its text only at the end"),
    (["--strategy", "sample", "--num-beams", "3"], "--num-beams 3 needs beam search, not --strategy sample"),
    (["--strategy", "greedy", "--draft", "SELF"], "--draft runs speculative decoding"),
])
def test_flags_the_strategy_would_drop_are_refused(ckpt, capsys, extra, message):
    d, _, _ = ckpt
    extra = [str(d) if x == "SELF" else x for x in extra]
    assert main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "2", *extra]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_prompt_says_so(ckpt, capsys):
    d, _, _ = ckpt
    assert main(["generate", "--checkpoint", str(d), "--prompt", "", "--no-bos"]) == 2
    assert "a prompt needs at least one token" in capsys.readouterr().err


def test_an_encoder_decoder_prints_its_output_for_the_source_it_was_trained_on(tmp_path, capsys):
    """Its source is read as training read sources (the text, then EOS), and its output is the decoder's tokens
    after the start token: printed alone, an answer rather than a continuation of the prompt."""
    tok = ByteTokenizer()
    model = tiny_encdec(seed=5, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                        eos_token_id=tok.eos_id, decoder_start_token_id=tok.bos_id)
    save_pretrained(model, tmp_path / "s2s")
    tok.save(tmp_path / "s2s" / "tokenizer.json")
    assert main(["generate", "--checkpoint", str(tmp_path / "s2s"), "--prompt", "May 4", "--max-new-tokens", "6",
                 "--no-pack", "--json", str(tmp_path / "o.json")]) == 0
    ref = generate(model, torch.tensor([tok.encode("May 4") + [tok.eos_id]]), max_new_tokens=6,
                   eos_token_id=tok.eos_id)
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["sequences"] == ref.tolist()
    text = tok.decode(ref[0, 1:].tolist())
    assert doc["outputs"] == [text.strip()] and capsys.readouterr().out == text.strip() + "\n"


def _saying_eos_where_it_said(model, said: int, eos: int) -> None:
    """Swap two output rows: the model now emits ``eos`` wherever it emitted ``said`` (and the reverse)."""
    with torch.no_grad():
        w = model.lm_head.proj.weight
        w[[said, eos]] = w[[eos, said]].clone()


def test_a_row_that_stops_early_prints_no_padding(tmp_path):
    """Without a pad token the finished row was filled with id 0 and its NULs printed (with a Llama 3 tokenizer
    that reads "!!!!"). Hugging Face pads with EOS, which decodes to nothing; and the text stops at the EOS anyway."""
    tok = ByteTokenizer(specials=["<bos>", "<eos>"])  # no <pad>
    prompts, T = ["hello", "a"], 6
    for seed in range(50):
        model = tiny_decoder(seed=seed, vocab_size=tok.vocab_size, max_seq_len=32, bos_token_id=tok.bos_id)
        rows = [[tok.bos_id, *tok.encode(p)] for p in prompts]
        ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
        free = generate(model, ids, attention_mask=(ids != 0).long(), max_new_tokens=8, eos_token_id=[])[:, T:]
        said = free[1, 1].item()  # row 1's second token becomes EOS; row 0 never says it
        if said not in free[0].tolist() and said != free[1, 0].item() and said not in (0, tok.eos_id):
            break
    _saying_eos_where_it_said(model, said, tok.eos_id)
    model.config.eos_token_id = tok.eos_id
    save_pretrained(model, tmp_path / "m")
    tok.save(tmp_path / "m" / "tokenizer.json")
    assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--prompt", prompts[0], "--prompt", prompts[1],
                 "--max-new-tokens", "8", "--no-accel", "--json", str(tmp_path / "out.json")]) == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["sequences"][1][T + 1:] == [tok.eos_id] * 7  # padded with EOS
    assert doc["outputs"][1] == tok.decode([free[1, 0].item()]) and "\x00" not in doc["outputs"][1]


def test_every_eos_a_config_lists_ends_generation_and_a_chat_turn(tmp_path):
    """A Hugging Face config's EOS list (Llama 3: end of text, end of message, end of turn) stops `generate()`;
    the CLI and the chat stopped only at the tokenizer's EOS and ran on past the others."""
    from seqlab.cli.chat import ChatSession
    from seqlab.generate.chat import end_ids, turn_end_ids

    tok = ByteTokenizer(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    end, eom, eot = (tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))
    model = tiny_decoder(seed=1, vocab_size=tok.vocab_size, max_seq_len=64)
    prompt = torch.tensor([list(b"hello")])
    free = generate(model, prompt, max_new_tokens=3, eos_token_id=[])[0, 5:].tolist()
    _saying_eos_where_it_said(model, free[2], eom)  # the third token is now <|eom_id|>
    model.config.eos_token_id = end
    model.config.extra["eos_token_ids"] = [end, eom, eot]
    assert eom in end_ids(tok, model.config) and eom in turn_end_ids(tok, model.config)
    save_pretrained(model, tmp_path / "m")
    tok.save(tmp_path / "m" / "tokenizer.json")
    assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "hello", "--no-bos",
                 "--max-new-tokens", "8", "--no-accel", "--json", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["sequences"][0][5:] == [*free[:2], eom]
    shown: list[str] = []
    reply = ChatSession(model, tok, max_new_tokens=8, temperature=0).reply("hello", on_text=shown.append)
    assert reply == tok.decode(free[:2]) and "".join(shown) == reply
