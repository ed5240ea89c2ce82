"""``torch.profiler`` on every rank, driven by rank 0 (``StartProfile`` / ``StopProfile``): rank 0 broadcasts a
:class:`ProfileControl` between steps, each rank's :class:`RankProfiler` starts or stops its profiler and answers
through the control plane; a stop writes one Chrome trace per rank. Which steps are traced is rank 0's
:class:`ProfilePlan` (``Engine.start_profile``). ``docs/metrics.md``, "Profiling"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "CUDA", "MEM")  # StartProfileRequest.activities this engine understands


class ProfileError(RuntimeError):
    """A profiling request that does not fit the engine's state (one already running, none to stop), or ranks that
    failed (named)."""


@dataclass(frozen=True, kw_only=True)
class ProfilePlan:
    """What ``StartProfile`` asked for: traces into ``trace_dir`` (already confined and created), named with
    ``stamp``; from when the engine's finished steps (EngineInfo ``steps.total``) reach ``start_step`` (None or past:
    at once) for ``num_steps`` steps (None: until stopped); ``activities`` among :data:`ACTIVITIES` (empty: CPU, and
    CUDA where there is one)."""

    trace_dir: str
    stamp: str
    start_step: int | None = None
    num_steps: int | None = None
    activities: tuple[str, ...] = ()
    record_shapes: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        bad = [a for a in self.activities if a.upper() not in ACTIVITIES]
        if bad:
            raise ValueError(f"activities: {bad} not among {list(ACTIVITIES)}")
        for name in ("start_step", "num_steps"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "start_step" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'start_step' else 1}, got {value}")


@dataclass(frozen=True)
class ProfileControl:
    """Broadcast to every rank: start profiling under ``plan``, or (``plan`` None) stop and write the trace."""

    plan: ProfilePlan | None


def trace_path(plan: ProfilePlan, rank: int) -> str:
    return os.path.join(plan.trace_dir, f"{plan.stamp}-rank{rank}.trace.json")


class RankProfiler:
    """One rank's ``torch.profiler``. :meth:`apply` runs a :class:`ProfileControl` and returns this rank's answer:
    "" (started), the trace's path (stopped), or ``"error: ..."``."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.prof: torch.profiler.profile | None = None
        self.plan: ProfilePlan | None = None

    def apply(self, control: ProfileControl) -> str:
        try:
            return self._start(control.plan) if control.plan is not None else self._stop()
        except Exception as err:  # noqa: BLE001 - reported to rank 0, which names the rank in the reply
            log.exception("profiler on rank %d failed", self.rank)
            self.prof = None
            return f"error: {type(err).__name__}: {err}"

    def _start(self, plan: ProfilePlan) -> str:
        wanted = {a.upper() for a in plan.activities} or {"CPU", "GPU"}
        activities = [torch.profiler.ProfilerActivity.CPU] if "CPU" in wanted or "MEM" in wanted else []
        if wanted & {"GPU", "CUDA"} and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities or [torch.profiler.ProfilerActivity.CPU],
                                           record_shapes=plan.record_shapes, with_stack=plan.with_stack,
                                           profile_memory="MEM" in wanted)
        self.prof.start()
        self.plan = plan
        return ""

    def _stop(self) -> str:
        if self.prof is None:
            return "error: not profiling"
        prof, self.prof = self.prof, None
        prof.stop()
        path = trace_path(self.plan, self.rank)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(path)
        return path


class ProfileDriver:
    """Rank 0's side: the plan asked for, and the control rounds that start and stop every rank's profiler.
    ``round(control)`` sends a :class:`ProfileControl` to every rank, rank 0 included, and returns each rank's answer
    (the engine's control plane: ``engine/worker/control.py``). ``steps``: the engine's finished step count, where
    ``start_step`` and ``num_steps`` are counted."""

    def __init__(self, round: Callable[[ProfileControl], list[str]]):
        self.send = round
        self.plan: ProfilePlan | None = None  # asked for; tracing once ``tracing`` is set
        self.tracing = False
        self._from = 0  # steps when tracing started

    def start(self, plan: ProfilePlan, steps: int) -> None:
        """Traces ``plan``'s steps on every rank: from now when ``plan.start_step`` is unset or past, else from that
        step on. Raises :class:`ProfileError` when a profile is already asked for or running, or naming the ranks
        whose profiler did not start."""
        if self.plan is not None:
            raise ProfileError(f"already profiling into {self.plan.trace_dir}; StopProfile first")
        self.plan = plan
        if plan.start_step is None or steps >= plan.start_step:
            self._start(steps)

    def stop(self) -> list[str]:
        """Stops tracing on every rank and returns the trace files (rank order); a profile not started yet is
        cancelled (no files). Raises :class:`ProfileError` when none was asked for, or naming the ranks that failed."""
        if self.plan is None:
            raise ProfileError("not profiling: StartProfile first (or its num_steps already ended it)")
        if not self.tracing:
            self.plan = None
            return []
        return self._round(ProfileControl(None))

    def before_step(self, steps: int) -> None:
        """Starts a profile whose ``start_step`` has come (a failure is logged, not raised: the step goes on)."""
        plan = self.plan
        if plan is not None and not self.tracing and plan.start_step is not None and steps >= plan.start_step:
            try:
                self._start(steps)
            except ProfileError as err:
                log.error("profile not started: %s", err)

    def after_step(self, steps: int) -> None:
        """Ends a profile that has traced its ``num_steps``."""
        plan = self.plan
        if self.tracing and plan.num_steps is not None and steps - self._from >= plan.num_steps:
            try:
                log.info("profile of %d steps written: %s", plan.num_steps,
                         ", ".join(self._round(ProfileControl(None))))
            except ProfileError as err:
                log.error("profile stopped with failures: %s", err)

    def close(self) -> None:
        """At shutdown: a profile still tracing is written."""
        if self.tracing:
            try:
                self._round(ProfileControl(None))
            except ProfileError as err:
                log.warning("profile at shutdown: %s", err)

    def _start(self, steps: int) -> None:
        self._round(ProfileControl(self.plan))
        self.tracing, self._from = True, steps

    def _round(self, control: ProfileControl) -> list[str]:
        """Broadcasts ``control``, applies it here and gathers every rank's answer. A stop ends the profile; a start
        that failed anywhere stops the ranks that did start and ends it too."""
        answers = self.send(control)
        failed = [f"rank {r}: {a}" for r, a in enumerate(answers) if a.startswith("error:")]
        if control.plan is None or failed:
            self.plan, self.tracing = None, False
        if control.plan is not None and failed:
            self.send(ProfileControl(None))
        if failed:
            raise ProfileError("; ".join(failed))
        return answers
