"""Per-request settings that cross every edge: sampling parameters and structured-output constraints."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


class SamplingError(ValueError):
    """A SamplingParams field is out of range; the message names the field."""


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint as the client sent it: ``kind`` one of :data:`CONSTRAINT_KINDS` and its
    ``text`` (a JSON schema, a regex, an EBNF grammar, a structural tag's JSON, the choices as a JSON list of strings;
    "" for ``json_object``). Hashable: compiled grammars are cached by it (``engine/sampling/grammar.py``)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise SamplingError(f"constraint must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")

    @property
    def field(self) -> str:
        """The ``SamplingParams`` field a client named it by (error messages)."""
        return f"sampling_params.{self.kind}"


@dataclass(frozen=True)
class Thought:
    """A constrained request whose answer starts inside the model's thought (``engine/reasoning.py``): its constraint
    applies once ``close_id`` is generated; ``close_id`` is the only token allowed after ``max_tokens`` thought tokens,
    and no stop token ends the request before the thought closes."""

    close_id: int
    max_tokens: int


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``temperature == 0`` is greedy; ``top_k`` -1 or 0, ``top_p`` 1 and ``min_p``
    0 are off. ``logprobs`` is how many top log-probs to return per token (0 = none). ``stop``: strings that end
    generation once the detokenized output contains one (``engine/stop_strings.py``; ``skip_special_tokens`` shapes
    that text, ``include_stop_str_in_output`` is the gateway's, which trims the text)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None
    n: int = 1
    thought: Thought | None = None  # the constraint waits for the thought's close (set by a reasoning parser)

    def __post_init__(self) -> None:
        stop_ok = isinstance(self.stop_token_ids, tuple) and all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        )
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0 and finite"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, ">= -1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"in [0, max_tokens={self.max_tokens}]"),
            ("logprobs", 0 <= self.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            ("stop_token_ids", stop_ok, "a tuple of non-negative ints"),
            ("stop", isinstance(self.stop, tuple) and all(isinstance(t, str) and t for t in self.stop),
             "a tuple of non-empty strings"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "> 0"),
            ("logit_bias", all(t >= 0 and math.isfinite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             "(token id >= 0, bias in [-100, 100]) pairs"),
            ("n", self.n >= 1, ">= 1"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise SamplingError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the request's token counts are kept on its ranks)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
