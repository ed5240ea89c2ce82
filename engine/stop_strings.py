"""Stop strings, matched on a request's incrementally detokenized output, vLLM's rules:

- the text grows token by token (:class:`IncrementalDetokenizer`: a token that ends inside a multi-byte character
  adds nothing until the character is complete), so a stop string may span tokens;
- the check starts once ``min_tokens`` tokens are out, and each token's check looks at the text it added plus the
  ``len(stop) - 1`` characters before it; the stop strings are tried in the request's order, the first found wins;
- generation ends at the token that completes the match (``finish_reason="stop"``, the matched string reported);
  that token is the last one returned, so the tokens returned and ``completion_tokens`` agree. The text is the
  gateway's to trim (``include_stop_str_in_output`` says whether the string stays in it).
"""

from __future__ import annotations

from typing import Protocol

PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output: a tokenizer may render a token by its left context


class Detokenize(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """The text a request's output tokens add, one token at a time (decoding short windows, not the whole output)."""

    def __init__(self, tokenizer: Detokenize, prompt: list[int], skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt[-PROMPT_CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)  # the window decoded: ids[prefix:]; the text of ids[:read] is out

    def add(self, token: int) -> str:
        """Appends ``token``; returns the text it completes ("" while it ends inside a character)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class StopStrings:
    """One request's stop-string check (``stops`` non-empty)."""

    def __init__(self, stops: tuple[str, ...], detokenizer: IncrementalDetokenizer):
        self.stops, self.detokenizer = stops, detokenizer
        self.keep = max(len(s) for s in stops) - 1  # characters of earlier text a match can start in
        self.tail = ""

    def add(self, token: int, check: bool) -> str | None:
        """Feeds one output token; ``check`` False while the request is short of ``min_tokens``. Returns the stop
        string this token completes, or None."""
        new = self.detokenizer.add(token)
        text, self.tail = self.tail + new, (self.tail + new)[-self.keep:] if self.keep else ""
        if not check or not new:
            return None
        return next((s for s in self.stops if text.find(s, max(len(text) - len(new) - len(s) + 1, 0)) >= 0), None)
