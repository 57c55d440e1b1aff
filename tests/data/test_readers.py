"""Every malformed input gives one clear DataError naming the file and the line."""

import json
import warnings

import pytest

from seqlab.data import ByteTokenizer, DataError, build_dataset
from seqlab.data.byte_tokenizer import byte_backend
from seqlab.data.tokenizer import Tokenizer
from seqlab.objectives import build_objective
from seqlab.data.readers import read_documents, read_jsonl, read_preferences, read_seq2seq, read_sft
from tests.objectives.helpers import TOK


def _write(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return p


def _jsonl(*objs):
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n"


GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("reader, name, content, message", [
    (read_seq2seq, "s.jsonl", _jsonl({"source": "a", "target": "b"}, '{"source": "a", "target": }'),
     r"s.jsonl:2: invalid JSON: Expecting value \(column 27\)"),
    (read_seq2seq, "s.jsonl", _jsonl({"source": "a", "target": "b"}, "", {"source": "x"}),
     r"s.jsonl:3: missing field 'target' \(have \['source'\]\)"),
    (read_seq2seq, "s.jsonl", _jsonl({"source": "a", "target": 5}), r"s.jsonl:1: field 'target' must be a string"),
    (read_seq2seq, "s.jsonl", _jsonl([1, 2]), r"s.jsonl:1: expected a JSON object \(one per line, JSONL\), got list"),
    (read_seq2seq, "a.json", json.dumps([{"source": "a", "target": "b"}], indent=2),
     r"a.json:1: invalid JSON: .* this looks like a JSON array: write one object per line \(JSONL\)"),
    (read_seq2seq, "empty.jsonl", "", r"empty.jsonl: file is empty"),
    (read_seq2seq, "blank.jsonl", "\n  \n", r"blank.jsonl: file is empty"),
    (read_documents, "empty.txt", "", r"empty.txt: file is empty"),
    (read_documents, "latin1.txt", "line one\nline two\ncaf\xe9\n".encode("latin-1"),
     r"latin1.txt:3: not valid UTF-8 \(byte 0xe9 in column 4, at byte 21 of the file\)"),
    (read_documents, "bom.txt", b"\xef\xbb\xbfline1\nab\xff", r"bom.txt:2: not valid UTF-8 \(byte 0xff in column 3, at byte 11 of the file\)"),
    (read_sft, "latin1.jsonl", b'{"messages": []}\n{"messages": "\xff"}\n', r"latin1.jsonl:2: not valid UTF-8"),
    (read_documents, "d.jsonl", _jsonl({"text": "ok"}, {"txt": "typo"}), r"d.jsonl:2: missing field 'text'"),
    (read_sft, "c.jsonl", _jsonl(GOOD_CHAT, {"msgs": []}), r"c.jsonl:2: missing field 'messages'"),
    (read_sft, "c.jsonl", _jsonl({"messages": [{"role": "robot", "content": "x"}]}),
     r"c.jsonl:1: messages\[0\]\.role is 'robot'"),
    (read_sft, "c.jsonl", _jsonl({"messages": [{"role": "user", "content": "x"}]}),
     r"c.jsonl:1: 'messages' has no assistant message"),
    (read_sft, "c.jsonl", _jsonl({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
     r"c.jsonl:1: messages\[0\] is missing field 'content'"),
    (read_sft, "c.jsonl", _jsonl({"messages": [{"role": "user", "content": "x"},
                                               {"role": "assistant", "tool_calls": [{"arguments": {}}]}]}),
     r"c.jsonl:1: messages\[1\]\.tool_calls\[0\] needs 'name' and 'arguments'"),
    (read_preferences, "p.jsonl", _jsonl({"prompt": "q", "chosen": "a"}), r"p.jsonl:1: missing field 'rejected'"),
    (read_preferences, "p.jsonl", _jsonl({"prompt": "q", "chosen": "", "rejected": "b"}),
     r"p.jsonl:1: field 'chosen' is empty"),
    (read_documents, "d.jsonl", '{"text": "ok \\ud83d\\ude00"}\n{"text": "a lone \\ud800 here"}\n',
     r"d.jsonl:2: holds a lone UTF-16 surrogate \('\\ud800'\)"),
    (read_sft, "c.jsonl", _jsonl({"messages": [{"role": "user", "content": "x\udfff"},
                                               {"role": "assistant", "content": "y"}]}),
     r"c.jsonl:1: holds a lone UTF-16 surrogate"),
])
def test_bad_input_names_file_and_line(tmp_path, reader, name, content, message):
    path = _write(tmp_path, name, content)
    with pytest.raises(DataError, match=message) as info:
        reader(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.txt: file not found"):
        read_documents(tmp_path / "nope.txt")


def test_good_files_and_split_rule(tmp_path):
    rows = [{"source": f"s{i}", "target": f"t{i}"} for i in range(40)]
    path = _write(tmp_path, "pairs.jsonl", _jsonl(*rows))
    train = build_dataset("seq2seq", path, TOK, 32, "train")
    val = build_dataset("seq2seq", path, TOK, 32, "validation")
    assert len(train) == 38 and len(val) == 2  # every 20th example is held out
    assert TOK.decode(val[0]["source_ids"]) == "s19" and TOK.decode(val[1]["target_ids"]) == "t39"
    assert len(build_dataset("seq2seq", path, TOK, 32, "all")) == 40

    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "function": {"name": "calc", "arguments": {"e": "2+2"}}}]},
                         {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}
    sft = build_dataset("sft", _write(tmp_path, "chat.jsonl", _jsonl(chat, GOOD_CHAT)), TOK, 256, "all")
    assert len(sft) == 2 and any(l != -100 for l in sft[0]["labels"])

    prefs = _write(tmp_path, "p.jsonl", _jsonl({"prompt": [{"role": "user", "content": "q"}], "chosen": "a",
                                                 "rejected": "b"}, {"prompt": "q2", "chosen": "c", "rejected": "d"}))
    dpo = build_dataset("dpo", prefs, TOK, 64, "train")
    assert len(dpo) == 1 and TOK.decode(dpo[0]["chosen_ids"], skip_special_tokens=False) == "a<|im_end|>"

    text = "\n".join(f"line {i}" for i in range(1000)) + "\n"
    txt = _write(tmp_path, "plain.txt", text)
    tr, va = build_dataset("clm", txt, TOK, 64, "train"), build_dataset("clm", txt, TOK, 64, "validation")
    assert tr.info["n_tokens"] + va.info["n_tokens"] == len(text) + 4  # BOS before and EOS after each part
    assert va[0][0] == TOK.bos_id and tr[0][0] == TOK.bos_id  # as generation and perplexity start a prompt
    assert TOK.decode(va[0][1:]).startswith("line 9")  # the last ~5 %, cut at a line break


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """U+2028, U+2029 and U+0085 may stand raw in a JSON string (``ensure_ascii=False`` writes them so): they do
    not end a JSONL line, and a CRLF file reads as an LF one."""
    rows = [{"source": f"a\u2028b\u2029c\u0085d {i}", "target": "x"} for i in range(3)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert [obj for _, obj in read_jsonl(_write(tmp_path, "u.jsonl", text))] == rows
    assert [n for n, _ in read_jsonl(_write(tmp_path, "crlf.jsonl", text.replace("\n", "\r\n")))] == [1, 2, 3]


def test_a_text_of_few_lines_holds_out_about_five_percent(tmp_path):
    """A one-paragraph-per-line file: the cut goes after a space near 95 %, not back to the last line break (which
    here would hand 99 % of the text to validation)."""
    from seqlab.data.datasets import split_text

    text = "My Essay\n\n" + " ".join(["alpha", "beta", "gamma", "delta"] * 1000) + "\n"
    val, train = split_text(text, "validation"), split_text(text, "train")
    assert train + val == text and 0.05 <= len(val) / len(text) <= 0.075
    assert train.endswith(" ") and not val.startswith(" ")
    lines = "".join(f"line {i}\n" for i in range(1000))  # many lines: still cut at one
    assert split_text(lines, "validation").startswith("line 95") and split_text(lines, "train").endswith("\n")


def test_cut_examples_are_counted_and_answerless_sft_rows_left_out(tmp_path):
    """An example longer than seq_len is cut with a warning naming the file and the count; an SFT example whose
    answer lies wholly past the cut is left out (it has no target, and a batch of such rows none at all)."""
    long_q = {"messages": [{"role": "user", "content": "q" * 80}, {"role": "assistant", "content": "a"}]}
    long_a = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 80}]}
    path = _write(tmp_path, "chats.jsonl", _jsonl(*([long_q, long_a, GOOD_CHAT] * 10)))
    with pytest.warns(UserWarning, match=r"chats.jsonl \(all\): 20 of 30 examples are longer than a row of 48 tokens .*"
                                         r"10 of them keep no answer token and are left out"):
        sft = build_dataset("sft", path, TOK, 48, "all")
    assert len(sft) == 20 and all(len(ex["input_ids"]) <= 48 for ex in sft)
    with pytest.raises(ValueError, match="no example keeps an answer token within --seq-len 16"):
        build_dataset("sft", _write(tmp_path, "q.jsonl", _jsonl(*[long_q] * 3)), TOK, 16, "all")

    pairs = _write(tmp_path, "pairs.jsonl", _jsonl(*[{"source": "s" * 40, "target": "t"}] * 3,
                                                   {"source": "s", "target": "t"}))
    with pytest.warns(UserWarning, match=r"3 of 4 examples are longer than a row of 16 tokens and are cut \(the longest "
                                         r"is 41 tokens\); raise --seq-len"):
        s2s = build_dataset("seq2seq", pairs, TOK, 16, "all")
    assert [len(ex["source_ids"]) for ex in s2s] == [16, 16, 16, len(TOK.encode("s")) + 1] and s2s[0]["source_ids"][-1] == TOK.eos_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing cut, nothing said
        build_dataset("seq2seq", pairs, TOK, 64, "all")


def test_one_token_between_documents_where_bos_is_eos(tmp_path):
    """A GPT-2-style tokenizer (BOS and EOS both <|endoftext|>): one separator between documents, as at inference,
    so no document is preceded by two and no free target is scored; the first document still starts with it."""
    tok = Tokenizer.from_backend(byte_backend(["<|endoftext|>"]), name="gpt2-like")
    assert tok.bos_id == tok.eos_id
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab", "cd", "ef", "gh"] * 5))
    row = build_dataset("clm", str(data), tok, seq_len=12, split="train")[0]
    end = tok.eos_id
    assert row[:7] == [end, *tok.encode("ab"), end, *tok.encode("cd"), end]
    obj = build_objective("clm", tok)
    targets = obj.targets(obj.collate([row]))[0].tolist()
    assert targets[:6] == [*tok.encode("ab"), end, *tok.encode("cd"), end]


def test_a_conversation_the_chat_template_refuses_names_its_file_and_line(tmp_path):
    """A template's raise_exception (roles that do not alternate) fires only when the example is tokenized: its
    error named neither the file nor the line."""
    template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    tok = ByteTokenizer(chat_template=template, eot_token="<eos>")
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}]}
    (tmp_path / "chats.jsonl").write_text(_jsonl(*[good] * 7, bad, *[good] * 5))
    with pytest.raises(DataError, match=r"chats\.jsonl:8: chat template error: roles must alternate"):
        build_dataset("sft", tmp_path / "chats.jsonl", tok, 64, "train")
    prefs = {"prompt": bad["messages"][:2], "chosen": "x", "rejected": "y"}
    (tmp_path / "prefs.jsonl").write_text(_jsonl(*[{"prompt": "q", "chosen": "x", "rejected": "y"}] * 2, prefs))
    with pytest.raises(DataError, match=r"prefs\.jsonl:3: chat template error: roles must alternate"):
        build_dataset("dpo", tmp_path / "prefs.jsonl", tok, 64, "all")
