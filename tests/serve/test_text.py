"""ReplyText: streamed pieces never include text that a stop string (or stripping) later removes."""

from __future__ import annotations

from seqlab.serve.text import ReplyText


class CharTokenizer:
    """Token ids are Unicode code points; 0xFFFD stands for half of a UTF-8 character."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _stream(text_ids, stop=(), strip=False):
    r = ReplyText(CharTokenizer(), list(stop), strip)
    pieces = []
    for t in text_ids:
        pieces.append(r.push(t))
        if r.stopped:
            break
    pieces.append(r.finish())
    return pieces, r


def test_a_possible_stop_prefix_is_held_back_and_the_stop_is_cut():
    pieces, r = _stream([ord(c) for c in "ab<|x<|end|>zz"], stop=["<|end|>"])
    assert r.stopped and "".join(pieces) == "ab<|x"
    assert pieces[:4] == ["a", "b", "", ""]  # "<" and "<|" could start the stop string


def test_held_back_prefix_is_released_when_it_does_not_complete():
    pieces, r = _stream([ord(c) for c in "a<b"], stop=["<|"])
    assert not r.stopped and pieces == ["a", "", "<b", ""]


def test_chat_replies_are_stripped_and_split_characters_wait():
    pieces, _ = _stream([ord(" "), ord("\n"), ord("h"), 0xFFFD, ord("i"), ord(" "), ord(" ")], strip=True)
    assert "".join(pieces) == "h\ufffdi"
    assert pieces[:3] == ["", "", "h"] and pieces[3] == ""


def test_a_stop_string_starting_in_the_stripped_whitespace_is_held_back():
    """A chat reply is left-stripped: the tail check ran on the stripped text, so "^" of the stop "\\t^x" was sent
    before the whole stop string arrived and cut the reply to nothing."""
    pieces, r = _stream([ord(c) for c in "\t^xyz"], stop=["\t^x"], strip=True)
    assert r.stopped and pieces == ["", "", "", ""]


def test_the_reply_is_cut_at_the_earliest_stop_whatever_their_order():
    """Cut at each stop string in list order, ["ed", "Re"] on "1. Red" kept "1. R", the start of a stop string."""

    class Pieces:
        pieces = ["1.", " ", "Red"]  # "Red" arrives as one token: both stops complete at once

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.pieces[i] for i in ids)

    for stop in (["ed", "Re"], ["Re", "ed"]):
        r = ReplyText(Pieces(), stop, strip=False)
        sent = r.push(0) + r.push(1) + r.push(2)
        assert r.stopped and r.text == sent == "1. ", stop


def test_a_completion_reads_on_from_its_prompt():
    """A completion's text came from its new tokens alone, so a SentencePiece decoder dropped the space before its
    first word: "To be" + "▁or ▁not" came back as "or not" (vLLM, and `seqlab generate`, give " or not")."""
    from tests.sp_tokenizer import sentencepiece_words

    tok = sentencepiece_words()
    prompt = tok.encode("To be")
    r = ReplyText(tok, [], strip=False, context=prompt[-1:])
    assert "".join(r.push(t) for t in tok.encode("or not")) + r.finish() == " or not"
