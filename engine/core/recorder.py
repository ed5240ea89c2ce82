"""Rank 0 builds one :class:`engine.core.step_record.StepRecord` per step and per idle heartbeat
(:class:`StepRecorder`); :class:`EngineStats` folds them into the counters EngineInfo reports. The engine calls the
recorder at fixed points of ``Engine.step``: a call begins, its plan is scheduled, its host phases end, its finished
steps are read back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.scheduler import SchedulerStats
from engine.core.step_record import (
    HOST_PHASES,
    IDLE_REASONS,
    LAUNCH_PARTS,
    RequestEnd,
    RequestTimes,
    StepRecord,
    TokenCounts,
    idle_seconds,
)
from engine.core.turns import Turn
from engine.step import GraphCoverage, RankReport, RequestOutput, StepKind, StepPlan, StepResult
from parallelism.comm import CommCounter


class DeviceSpan:
    """CUDA events around a step's launch on rank 0: :meth:`ms` is the device time from the step's first queued work
    to its last (gaps inside included), read after the step's readback without waiting — None when the end event has
    not completed then (a prefill chunk that samples nothing has no readback to wait for; the host never waits
    for a span)."""

    def __init__(self):
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record()

    @staticmethod
    def open(device: torch.device) -> DeviceSpan | None:
        return DeviceSpan() if device.type == "cuda" else None

    def stop(self) -> None:
        self.end.record()

    def ms(self) -> float | None:
        return self.start.elapsed_time(self.end) if self.end.query() else None


@dataclass
class _Clock:
    """One request's times (monotonic seconds): arrival, first admission, its latest tokens."""

    arrival: float
    scheduled: float | None = None
    last_token: float | None = None
    turn: Turn | None = None  # a chat answer watched for an empty turn (engine/core/turns.py)


class StepRecorder:
    """Rank 0's record builder. Holds what a record needs from before its step: when the previous record ended,
    the host phases of calls not yet attributed, the counters' values at the previous record, request clocks."""

    def __init__(self, stats: Callable[[], SchedulerStats], counter: CommCounter, clock=time.monotonic):
        """``stats``: the scheduler's (``Scheduler.stats``), read at each event and record."""
        self.stats, self.counter, self.clock = stats, counter, clock
        self.prev_end = clock()
        self._start: float | None = None  # the first Engine.step call not yet attributed to a record
        self._host = dict.fromkeys(HOST_PHASES + LAUNCH_PARTS, 0.0)
        self._blocked = ""
        self._comm = self._comm_now()
        self._kv = self._kv_totals(stats())
        self._clocks: dict[str, _Clock] = {}
        self._arrivals: list[float] = []  # of requests added since the previous record
        self._ended: list[RequestEnd] = []  # aborts since the previous record
        self._empty_from: float | None = self.prev_end  # since when the engine has held no request (None: it holds)

    # ---- events between records -------------------------------------------------------------------------
    def arrived(self, request_id: str, at: float, turn: Turn | None = None) -> None:
        self._clocks[request_id] = _Clock(at, turn=turn)
        self._arrivals.append(at)

    def begin(self, at: float) -> None:
        """An ``Engine.step`` call starts."""
        if self._start is None:
            self._start = at

    def host(self, phase: str, seconds: float) -> None:
        self._host[phase] += seconds

    def scheduled(self, plan: StepPlan, at: float, blocked: str) -> None:
        """``plan`` was scheduled at ``at``; ``blocked``: why it left work waiting (``Scheduler.blocked``)."""
        for per_rank in plan.work:
            for w in per_rank:
                clock = self._clocks.get(w.request_id)
                if clock is not None and clock.scheduled is None:
                    clock.scheduled = at
        self._blocked = blocked

    def aborted(self, out: RequestOutput, at: float, has_work: bool) -> None:
        """An abort between steps (``has_work``: whether the engine still holds requests): its end rides on the next
        record."""
        self._ended += self._end(out, at)
        if self._empty_from is None and not has_work:
            self._empty_from = at

    # ---- records ------------------------------------------------------------------------------------------
    def step(self, plan: StepPlan, reports: list[RankReport], results: dict[str, StepResult],
             outputs: list[RequestOutput], device_ms: float | None, draining: bool) -> StepRecord:
        """The record of ``plan``, read back with every rank's ``reports`` (rank order; ``results`` merged from
        them), giving ``outputs``."""
        now = self.clock()
        start = self._start if self._start is not None else now
        gap, wall = max(start - self.prev_end, 0.0), now - start
        host = {k: 1e3 * v for k, v in self._host.items()}
        off_device = wall - device_ms / 1e3 if device_ms is not None else (host["schedule"] + host["update"]) / 1e3
        idle = idle_seconds(gap_s=gap, gap_empty_s=self._empty_until(start), wall_s=wall, host_s=off_device,
                            blocked=self._blocked, draining=draining)
        emitted = {o.request_id: len(o.new_tokens) for o in outputs}
        prompt = decoded = committed = 0
        accepted, by_dp = [], []
        for per_rank in plan.work:  # one pass over the step's items
            given = 0
            for w in per_rank:
                n = emitted.get(w.request_id)
                given += n or 0
                if not w.decode:
                    prompt += len(w.token_ids)
                    continue
                k = len(results[w.request_id].tokens)
                decoded += k if n is not None else 0
                if w.spec:
                    committed += k
                    accepted.append(k - 1)
            by_dp.append(given)
        s = self.stats()
        queried, cached, preempted = self._kv_deltas(s)
        tokens = TokenCounts(prompt_computed=prompt, prompt_queried=queried, prompt_cached=cached,
                             generated=sum(emitted.values()), decoded=decoded, spec_requests=len(accepted),
                             spec_committed=committed)
        record = StepRecord(
            step_id=plan.step_id, kind=plan.kind, t_end=now, gap_s=gap, wall_s=wall, host_ms=host, device_ms=device_ms,
            tokens=tokens, generated_by_dp=tuple(by_dp), accepted=tuple(accepted),
            graphs=tuple(r.coverage for r in reports), comm=self._comm_delta(), kv=s.per_dp,
            preemptions=preempted, requests=self._times(outputs, now), telemetry=_samples(reports), idle_s=idle)
        self._close(now, s)
        return record

    def heartbeat(self, reports: list[RankReport], started: float, draining: bool) -> StepRecord:
        """The record of an idle heartbeat that started at ``started`` (no forward: every second is idle)."""
        now = self.clock()
        gap = max(now - self.prev_end, 0.0)
        idle = idle_seconds(gap_s=gap, gap_empty_s=self._empty_until(now), wall_s=0.0, host_s=0.0, blocked="",
                            draining=draining)
        s = self.stats()
        queried, cached, preempted = self._kv_deltas(s)
        record = StepRecord(step_id=None, kind=None, t_end=now, gap_s=max(started - self.prev_end, 0.0),
                            wall_s=now - started, tokens=TokenCounts(prompt_queried=queried, prompt_cached=cached),
                            comm=self._comm_delta(), kv=s.per_dp, preemptions=preempted,
                            requests=self._times([], now), telemetry=_samples(reports), idle_s=idle)
        self._close(now, s)
        return record

    # ---- helpers ------------------------------------------------------------------------------------------
    def _empty_until(self, end: float) -> float:
        """Seconds between the previous record and ``end`` with no request in the engine: from when it was last
        empty until the first request added since (none: until ``end``)."""
        if self._empty_from is None:
            return 0.0
        first = min(self._arrivals, default=end)
        return max(min(first, end) - max(self._empty_from, self.prev_end), 0.0)

    def _close(self, now: float, s: SchedulerStats) -> None:
        self.prev_end, self._start = now, None
        self._host = dict.fromkeys(self._host, 0.0)
        self._arrivals.clear()
        self._empty_from = None if s.has_work else now

    def _times(self, outputs: list[RequestOutput], now: float) -> RequestTimes:
        ttft, itl, prompts, cached = [], [], 0, 0
        ended, self._ended = self._ended, []
        for o in outputs:
            clock = self._clocks.get(o.request_id)
            if clock is None:
                continue
            if clock.turn is not None:
                clock.turn.see(o.new_tokens)
            if o.new_tokens:
                if clock.last_token is None:
                    ttft.append(now - clock.arrival)
                    prompts, cached = prompts + o.num_prompt_tokens, cached + o.num_cached_tokens
                else:
                    itl.append(now - clock.last_token)
                clock.last_token = now
            if o.finished:
                ended += self._end(o, now)
        return RequestTimes(ttft_s=tuple(ttft), itl_s=tuple(itl), first_prompt_tokens=prompts,
                            first_cached_tokens=cached, ended=tuple(ended))

    def _end(self, out: RequestOutput, now: float) -> list[RequestEnd]:
        clock = self._clocks.pop(out.request_id, None)
        if clock is None:
            return []
        queued = (clock.scheduled if clock.scheduled is not None else now) - clock.arrival
        return [RequestEnd(finish_reason=out.finish_reason or "abort", prompt_tokens=out.num_prompt_tokens,
                           generation_tokens=out.num_output_tokens, e2e_s=now - clock.arrival, queue_s=queued,
                           empty_turn=clock.turn is not None and clock.turn.empty(out.finish_reason))]

    def _comm_now(self) -> dict[tuple[str, str], tuple[int, int]]:
        c = self.counter
        return {k: (c.calls[k], c.bytes[k]) for k in list(c.calls)}

    def _comm_delta(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Calls and bytes since the previous record (after a counter reset: since the reset)."""
        now, prev = self._comm_now(), self._comm
        self._comm = now
        out = {}
        for k, (calls, nbytes) in now.items():
            c0, b0 = prev.get(k, (0, 0))
            if calls < c0:  # the counter was reset
                c0 = b0 = 0
            if calls > c0:
                out[k] = (calls - c0, nbytes - b0)
        return out

    @staticmethod
    def _kv_totals(s: SchedulerStats) -> tuple[int, int, int]:
        return s.prompt_tokens, s.cached_tokens, s.preemptions

    def _kv_deltas(self, s: SchedulerStats) -> tuple[int, int, int]:
        """Prompt tokens looked up and served by the prefix cache, and preemptions, since the previous record."""
        now = self._kv_totals(s)
        deltas = tuple(b - a for a, b in zip(self._kv, now, strict=True))
        self._kv = now
        return deltas


def _samples(reports: list[RankReport]) -> dict[int, dict]:
    return {rank: r.telemetry for rank, r in enumerate(reports) if r.telemetry is not None}


@dataclass
class EngineStats:
    """The counters EngineInfo reports, folded from the step records (:meth:`observe`); idle heartbeats add only
    their idle seconds."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_kinds: dict[StepKind, int] = field(default_factory=dict)  # a speculative step counts as VERIFY
    spec_request_steps: int = 0  # (request, target forward) pairs that verified a tree
    spec_tokens: int = 0  # tokens those committed, bonus included
    warmup_s: float = 0.0  # Engine.warm_up: every static shape run (captured on CUDA) before serving
    # per static shape: kind, batch, tree_size, seconds, graph, skipped, reason (the prefill: tokens, not tree_size)
    warmup_shapes: list[dict] = field(default_factory=list)
    # rank 0's host seconds per phase of Engine.step: schedule, launch (broadcast + queue the step; off CUDA it
    # computes there; of it the speculator's draft and the target step), readback (wait for the step's tokens +
    # gather them), update (scheduler, outputs)
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOST_PHASES + LAUNCH_PARTS, 0.0))
    device_s: float = 0.0  # rank 0's device spans (CUDA), over device_steps steps
    device_steps: int = 0
    idle_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(IDLE_REASONS, 0.0))
    coverage: GraphCoverage = field(default_factory=GraphCoverage)  # rank 0's steps, draft and commit
    telemetry: dict[int, dict] = field(default_factory=dict)  # each rank's newest sample

    def observe(self, record: StepRecord) -> None:
        for reason, seconds in record.idle_s.items():
            self.idle_s[reason] += seconds
        self.telemetry.update(record.telemetry)
        if record.kind is None:
            return
        t = record.tokens
        self.steps += 1
        self.step_kinds[record.kind] = self.step_kinds.get(record.kind, 0) + 1
        self.prefill_tokens += t.prompt_computed
        self.decode_tokens += t.decoded
        self.spec_request_steps += t.spec_requests
        self.spec_tokens += t.spec_committed
        if record.kind in (StepKind.DECODE, StepKind.VERIFY):
            self.decode_s += record.wall_s
        else:
            self.prefill_s += record.wall_s
        for phase, ms in record.host_ms.items():
            self.host_s[phase] += ms / 1e3
        if record.device_ms is not None:
            self.device_s += record.device_ms / 1e3
            self.device_steps += 1
        for kind, (replayed, reason) in record.graphs[0].items():
            self.coverage.record(kind, replayed, reason)

    @property
    def acceptance_length(self) -> float:
        """τ: committed tokens per target forward per request (bonus included); 0 without speculation."""
        return self.spec_tokens / self.spec_request_steps if self.spec_request_steps else 0.0
