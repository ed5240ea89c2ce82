"""The worker's reasoning parser (``server.reasoning_parser``): where a thinking model's thought opens and closes,
so that a request's constraint waits for the close (``constrained_decoding_start = "after_reasoning"``, vLLM's
structured outputs with a reasoning parser and ``enable_in_reasoning`` off).

A request gets a :class:`~engine.params.Thought` when it is constrained, its gateway did not lead the constraint with
the thought itself (``grammar_from_first_token``), and its prompt ends inside a thought: the last thought marker in
the prompt is the open one (Kimi K2-Thinking's template opens the assistant turn with ``<think>``; with
``chat_template_kwargs: {"thinking": false}`` it renders ``<think></think>``, and the grammar starts at once). The
ranks then hold the grammar back (``engine/sampling/thought_gate.py``) and force the close after
``server.max_thinking_tokens``, so a constrained answer always closes its thought.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.params import SamplingParams, Thought

MARKERS = {"kimi": ("<think>", "</think>")}  # parser name → (open, close) text, each one token of the checkpoint


@dataclass(frozen=True)
class ReasoningParser:
    """``name``'s thought markers as the checkpoint's token ids, and the thought budget of a constrained answer."""

    name: str
    open_id: int
    close_id: int
    max_thinking_tokens: int

    @staticmethod
    def for_checkpoint(name: str, tokenizer, max_thinking_tokens: int) -> ReasoningParser:
        """Raises ValueError naming ``server.reasoning_parser`` for an unknown parser or a checkpoint whose
        tokenizer does not hold each marker as one token."""
        if name not in MARKERS:
            raise ValueError(f"server.reasoning_parser={name!r} is not known; known: {sorted(MARKERS)} (or null)")
        if max_thinking_tokens < 1:
            raise ValueError(f"server.max_thinking_tokens must be >= 1, got {max_thinking_tokens}")
        if tokenizer is None:
            raise ValueError(f"server.reasoning_parser={name}: the checkpoint has no tokenizer")
        ids = []
        for marker in MARKERS[name]:
            encoded = tokenizer.encode(marker)
            if len(encoded) != 1:
                raise ValueError(f"server.reasoning_parser={name}: the checkpoint's tokenizer has no single token for "
                                 f"{marker!r} (it encodes to {encoded})")
            ids.append(encoded[0])
        return ReasoningParser(name, ids[0], ids[1], max_thinking_tokens)

    def thought_open(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` ends inside a thought: its last thought marker is the open one."""
        for token in reversed(prompt):
            if token in (self.open_id, self.close_id):
                return token == self.open_id
        return False

    def gate(self, prompt: Sequence[int], params: SamplingParams, grammar_from_first_token: bool) -> SamplingParams:
        """``params`` with a :class:`Thought` when the constraint must wait for the thought's close."""
        if params.constraint is None or grammar_from_first_token or not self.thought_open(prompt):
            return params
        return dataclasses.replace(params, thought=Thought(self.close_id, self.max_thinking_tokens))
