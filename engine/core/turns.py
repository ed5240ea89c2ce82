"""Empty turns: a chat answer that ended (``finish_reason="stop"``) with neither content nor a call — nothing but a
stop token after its thought's close ``</think>``, or no close at all. Counted, not prevented: the stats record's
:class:`~engine.core.step_record.RequestEnd` says so (``empty_turn``) and ``/metrics`` sums it
(``switchyard:empty_turns_total``; docs/metrics.md). Kimi's K2 users report such turns after a tool result on
open-source stacks (MoonshotAI/Kimi-K2#128)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THOUGHT_MARKERS = ("<think>", "</think>")  # Kimi's, one token each where the checkpoint has them


def thought_marker_ids(tokenizer) -> tuple[int, int] | None:
    """``(open, close)`` ids of the thought markers where the tokenizer holds each as one token, else None."""
    if tokenizer is None:
        return None
    ids = [tokenizer.encode(m) for m in THOUGHT_MARKERS]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


@dataclass
class Turn:
    """One chat answer, watched token by token: ``thinking`` until the close, ``answered`` once any token but a
    stop (``stops``) follows it."""

    close_id: int
    stops: frozenset[int]
    thinking: bool
    answered: bool = False

    @staticmethod
    def of(prompt: Sequence[int], markers: tuple[int, int] | None, stops: frozenset[int]) -> Turn | None:
        """The turn ``prompt`` opens: watched when its last thought marker is there (a thinking model's chat turn,
        thinking on — ``<think>`` — or off — ``<think></think>``); None otherwise."""
        if markers is None:
            return None
        for token in reversed(prompt):
            if token in markers:
                return Turn(markers[1], stops, thinking=token == markers[0])
        return None

    def see(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.thinking:
                self.thinking = t != self.close_id
            elif t not in self.stops:
                self.answered = True

    def empty(self, finish_reason: str | None) -> bool:
        return finish_reason == "stop" and not self.answered
