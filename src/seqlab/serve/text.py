"""Incremental reply text for one request: what may be sent to the client now, and whether a stop string ended it.

Why held back text: a streamed piece can never be taken back, so the stream withholds (1) a trailing U+FFFD (a
UTF-8 character split between tokens, which the next token completes), (2) any tail that could be the start of a
stop string (the reply is cut before a stop string, which must never reach the client), and (3) for chat replies,
trailing whitespace (chat replies are stripped, as in ``seqlab chat``). The concatenated pieces therefore always
equal the final text.
"""

from __future__ import annotations

from seqlab.generate.text import read_on


class ReplyText:
    def __init__(self, tokenizer, stop: list[str], strip: bool, context: list[int] = ()):
        """``context``: a completion's last prompt token, which its text reads on from (a SentencePiece decoder
        drops the space of a text's first word: "To be" + "▁tis" came back as "tis", where vLLM says " tis")."""
        self.tokenizer, self.stop, self.strip = tokenizer, stop, strip
        self.context = list(context)
        self.ids: list[int] = []
        self.sent = 0  # characters of the visible text already handed out
        self.text = ""  # the visible text so far (cut at a stop string, left-stripped for chat)
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one generated token; return the piece that may be sent now (sets ``stopped`` on a stop string)."""
        self.ids.append(token)
        raw = read_on(self.tokenizer, self.context, self.ids)
        cuts = [i for i in (raw.find(s) for s in self.stop) if i >= 0]
        if cuts:  # at the earliest match: cutting at each in list order could keep the start of an earlier one
            raw, self.stopped = raw[: min(cuts)], True
        lead = len(raw) - len(raw.lstrip()) if self.strip else 0
        self.text = raw[lead:]
        # the held-back tail is found in the text as generated: a stop string may begin in the stripped whitespace
        return "" if self.stopped else self._release(max(self._safe_end(raw) - lead, self.sent))

    def finish(self) -> str:
        """The rest of the text once the reply is over (nothing more will come)."""
        end = len(self.text.rstrip()) if self.strip else len(self.text)
        if self.strip:
            self.text = self.text.rstrip()
        return self._release(end)

    def _safe_end(self, text: str) -> int:
        end = len(text)
        if text.endswith("\ufffd"):
            return 0
        for s in self.stop:  # longest tail of the text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    end = min(end, len(text) - k)
                    break
        if self.strip:
            end = min(end, len(text[:end].rstrip()))
        return end

    def _release(self, end: int) -> str:
        piece = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return piece
