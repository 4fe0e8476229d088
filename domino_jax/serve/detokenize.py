"""Streamed text of a growing token list, cut at the first stop string.

    text = TextStream(tokenizer, stops=["\\n\\n"])
    for token in tokens:
        delta = text.add(token)        # text safe to send now ("" while held back)
        if text.stopped: break         # a stop string appeared: the text before it is final
    delta += text.flush()              # at the end: what was held back

Decoding is incremental (the prefix-offset scheme of TGI and vLLM): each token decodes a
short window, not the whole output, and a window whose text ends in an incomplete UTF-8
character (``"\\ufffd"``) waits for the next token. Text that could be the start of a stop
string is held back until it cannot be, so a stop string never reaches the client (OpenAI's
rule: the stop sequence is not part of the text). Special tokens are skipped.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Incremental detokenizer with stop strings (see the module doc). ``tokens``: every
    token added; ``stopped``: a stop string was found (then ``tokens`` ends with the token
    that completed it and :meth:`add` must not be called again)."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []
        self.stopped = False
        self._prefix = self._read = 0      # decode window [prefix, end); text after read new
        self._pending = ""                  # decoded, not yet sent (may start a stop string)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Add one token; the text that can be sent now."""
        if self.stopped:
            raise RuntimeError("TextStream.add after a stop string")
        self.tokens.append(int(token))
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._pending += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._release()

    def flush(self) -> str:
        """At the end of the output: everything not sent yet (no stop string found)."""
        if self.stopped:
            return ""
        rest = self._decode(self.tokens[self._prefix:])
        before = self._decode(self.tokens[self._prefix:self._read])
        self._pending += rest[len(before):]
        self._prefix = self._read = len(self.tokens)
        out = self._cut_at_stop()
        if out is None:
            out, self._pending = self._pending, ""
        return out

    def _cut_at_stop(self) -> str | None:
        """The text before the first stop string in the pending text (then ``stopped``),
        or ``None`` when none is in it."""
        found = [i for s in self.stops if (i := self._pending.find(s)) >= 0]
        if not found:
            return None
        out, self._pending, self.stopped = self._pending[:min(found)], "", True
        return out

    def _release(self) -> str:
        out = self._cut_at_stop()
        if out is not None:
            return out
        hold = 0                           # the longest tail that starts a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(s[:k]):
                    hold = k
                    break
        out = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        return out
