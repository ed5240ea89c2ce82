"""Stop strings, matched on a request's incrementally detokenized output, vLLM's rules:

- the text grows token by token (:class:`IncrementalDetokenizer`: a token that ends inside a multi-byte character
  adds nothing until the character is complete), so a stop string may span tokens;
- the check starts once ``min_tokens`` tokens are out, and each token's check looks at the text it added plus the
  ``len(stop) - 1`` characters before it; the stop strings are tried in the request's order, the first found wins;
- generation ends at the token that completes the match (``finish_reason="stop"``, the matched string reported);
  that token is the last one returned, so the tokens returned and ``completion_tokens`` agree. The text is the
  gateway's to trim (``include_stop_str_in_output`` says whether the string stays in it).

The check runs on the engine thread, outside the core (:class:`StopChecks`): between a step's readback and the
core's update it reads each result and tells the core the index of the token that completes a match; the core cuts
the result there, as it cuts at a stop id, so a request stops at the same step, and a DDTree step at the same token,
as when the scheduler matched strings itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from engine.params import SamplingParams
from engine.step import RequestOutput, StepResult, sample_id

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


class StopChecks:
    """The stop-string checks of every running request that has stop strings, keyed by the core's id of each sample
    (a request's own id, or ``engine.core.requests.sample_id`` of each of its n samples)."""

    def __init__(self, tokenizer: Detokenize | None):
        self.tokenizer = tokenizer
        self._checks: dict[str, tuple[StopStrings, int]] = {}  # id → (its check, min_tokens)
        self._seen: dict[str, int] = {}  # id → output tokens fed to its check

    def add(self, keys: list[str], prompt: list[int], params: SamplingParams) -> None:
        """Starts the check of each sample ``keys`` of a request with ``params.stop`` (none without; the engine
        refuses stop strings when it has no tokenizer)."""
        if not params.stop:
            return
        for key in keys:
            detok = IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens)
            self._checks[key], self._seen[key] = (StopStrings(params.stop, detok), params.min_tokens), 0

    def scan(self, results: Mapping[str, StepResult]) -> dict[str, tuple[int, str]]:
        """Feeds each checked request's new tokens; returns id → (index of the token that completes a stop string,
        the string) for those that matched. Every token is fed until then, to keep the text whole."""
        found = {}
        for key, result in results.items():
            entry = self._checks.get(key)
            if entry is None:
                continue
            check, min_tokens = entry
            for i, token in enumerate(result.tokens):
                self._seen[key] += 1
                matched = check.add(token, self._seen[key] >= min_tokens)
                if matched is not None:
                    found[key] = (i, matched)
                    break
        return found

    def ended(self, outputs: list[RequestOutput]) -> None:
        """The samples these outputs end drop their checks."""
        if not self._checks:
            return
        for o in outputs:
            if o.finished:
                for key in (o.request_id, sample_id(o.request_id, o.index)):
                    self._checks.pop(key, None)
                    self._seen.pop(key, None)

