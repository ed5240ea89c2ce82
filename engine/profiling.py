"""``torch.profiler`` on every rank, driven by rank 0 (``StartProfile`` / ``StopProfile``): rank 0 broadcasts a
:class:`ProfileControl` between steps, each rank's :class:`RankProfiler` starts or stops its profiler and answers
through the control plane; a stop writes one Chrome trace per rank. Which steps are traced is rank 0's
:class:`ProfilePlan` (``Engine.start_profile``). ``docs/metrics.md``, "Profiling"."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "CUDA", "MEM")  # StartProfileRequest.activities this engine understands


@dataclass(frozen=True, kw_only=True)
class ProfilePlan:
    """What ``StartProfile`` asked for: traces into ``trace_dir`` (already confined and created), named with
    ``stamp``; from engine step ``start_step`` (``EngineInfo`` ``steps.total``; None or past: the next step) for
    ``num_steps`` steps (None: until stopped); ``activities`` among :data:`ACTIVITIES` (empty: CPU, and CUDA where
    there is one)."""

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
