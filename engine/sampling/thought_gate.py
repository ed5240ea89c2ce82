"""A constrained request's grammar held back until its thought closes (``engine/reasoning.py``): the xgrammar
matcher wrapped in the thought's state, with the matcher's own interface (accept, roll back, fill, terminated), so
plain rows, DDTree nodes and DFlash chains walk it as they walk any grammar — a node's path says whether the close
lies behind it."""

from __future__ import annotations

from torch import Tensor

from engine.params import Thought


def _row(words: int, allowed: set[int] | None = None, banned: set[int] = frozenset()) -> list[int]:
    """One int32 bitmask row as Python ints: ``allowed`` ids (None: all) minus ``banned``."""
    bits = [0] * words if allowed is not None else [(1 << 32) - 1] * words
    for i in allowed or ():
        bits[i // 32] |= 1 << (i % 32)
    for i in banned:
        bits[i // 32] &= ~(1 << (i % 32))
    return [b - (1 << 32) if b >= 1 << 31 else b for b in bits]


class ThoughtGate:
    """``matcher`` (an ``xgrammar.GrammarMatcher``) behind an open thought: until ``thought.close_id`` is accepted,
    any token but a stop token (``stop_ids``) or a special one (``special``: the tokenizer's control and reserved
    ids; structure, never text) is allowed and nothing reaches the matcher; the close is the one special token
    allowed, and after ``thought.max_tokens`` thought tokens the only one. Tokens after the close go to the
    matcher."""

    def __init__(self, matcher, thought: Thought, stop_ids: tuple[int, ...], special: frozenset[int], words: int):
        self.matcher, self.close, self.budget = matcher, thought.close_id, thought.max_tokens
        self.stop = (frozenset(stop_ids) | special) - {self.close}
        self.thinking, self.count = True, 0
        self.history: list[tuple[bool, int]] = []  # (thinking, count) before each accepted token
        self.free_row = _row(words, banned=set(self.stop))
        self.close_row = _row(words, allowed={self.close})

    def accept_token(self, token: int) -> bool:
        if not self.thinking:
            if not self.matcher.accept_token(token):
                return False
            self.history.append((False, self.count))
            return True
        if token != self.close and (token in self.stop or self.count >= self.budget):
            return False
        self.history.append((True, self.count))
        if token == self.close:
            self.thinking = False
        else:
            self.count += 1
        return True

    def rollback(self, n: int) -> None:
        if not n:
            return
        undone = self.history[-n:]
        del self.history[-n:]
        forwarded = sum(not thinking for thinking, _ in undone)
        if forwarded:
            self.matcher.rollback(forwarded)
        self.thinking, self.count = undone[0]

    @property
    def stop_token_ids(self) -> list[int]:
        return self.matcher.stop_token_ids

    def is_terminated(self) -> bool:
        return not self.thinking and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, masks: Tensor, row: int) -> None:
        if not self.thinking:
            self.matcher.fill_next_token_bitmask(masks, row)
            return
        masks[row] = masks.new_tensor(self.close_row if self.count >= self.budget else self.free_row)
