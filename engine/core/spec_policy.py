"""When a step speculates (rank 0): ``spec_decode.adaptive`` chooses, step by step, a speculative (draft + verify)
step or a plain decode step from what this engine measured on its own device — the acceptance of recent verify steps
and the wall seconds of verify and decode steps at the step's batch size — and tries speculation again now and then.
Off, every decode speculates. The choice changes which steps run, never a token (both kinds are lossless), and every
rank of a step runs the same kind, so static steps and batch invariance are unaffected (docs/sampling.md)."""

from __future__ import annotations

from typing import Protocol

from engine.core.step_record import StepRecord
from engine.step import StepKind


class SpecPolicy(Protocol):
    def speculate(self, batch: int) -> bool:
        """Whether a step decoding ``batch`` requests speculates."""
        ...

    def observe(self, record: StepRecord) -> None:
        """A step ran (its record, after the readback)."""
        ...


class AlwaysSpeculate:
    """``spec_decode.adaptive=false`` (and speculation off: the planner never asks)."""

    def speculate(self, batch: int) -> bool:
        return True

    def observe(self, record: StepRecord) -> None:
        pass


class MeasuredSpeculation:
    """Speculate at batch b iff ``τ × t_decode(b) ≥ t_verify(b)``: the tokens per request a verify step commits
    (τ, bonus included) cost no more than as many decode steps. ``t_*(b)``: exponential averages (weight ``alpha``)
    of the wall seconds of decode steps and verify steps of b requests, τ of verify steps at any batch. A batch size
    not yet measured runs the unmeasured kind first (verify, then decode); after ``probe`` plain steps in a row a
    verify step runs to refresh τ."""

    def __init__(self, alpha: float = 0.2, probe: int = 16):
        self.alpha, self.probe = alpha, probe
        self.tau: float | None = None
        self.seconds: dict[tuple[StepKind, int], float] = {}
        self.plain_run = 0  # plain steps since the last verify

    def speculate(self, batch: int) -> bool:
        verify, decode = self.seconds.get((StepKind.VERIFY, batch)), self.seconds.get((StepKind.DECODE, batch))
        if verify is None or self.tau is None:
            return True
        if decode is None:
            return False
        if self.tau * decode >= verify or self.plain_run >= self.probe:
            return True
        self.plain_run += 1
        return False

    def observe(self, record: StepRecord) -> None:
        t = record.tokens
        if record.kind == StepKind.VERIFY and t.spec_requests:
            self._average((StepKind.VERIFY, t.spec_requests), record.wall_s)
            tau = t.spec_committed / t.spec_requests
            self.tau = tau if self.tau is None else self.tau + self.alpha * (tau - self.tau)
            self.plain_run = 0
        elif record.kind == StepKind.DECODE and t.decoded:
            self._average((StepKind.DECODE, t.decoded), record.wall_s)

    def _average(self, key: tuple[StepKind, int], seconds: float) -> None:
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.alpha * (seconds - old)
