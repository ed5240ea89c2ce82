"""What every GPU check shares: the one CUDA timer and a budgeted loop over cases that keeps failing rows."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def cuda_time_s(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call of ``fn()``, CUDA events around each call (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def check_rows(cases: list[dict], check: Callable[..., dict], budget_s: float) -> list[dict]:
    """``check(**case)`` for each case until ``budget_s`` seconds have passed (the rest: ``skipped``). A case that
    raises keeps the error in its row, so one failing shape (a kernel out of shared memory at budget 256, say)
    does not lose the rows of the others."""
    t0, rows = time.time(), []
    for case in cases:
        if time.time() - t0 > budget_s:
            rows.append({**case, "skipped": "time budget"})
            continue
        try:
            rows.append(check(**case))
        except Exception as exc:  # noqa: BLE001 - recorded in the report, the next case still runs
            rows.append({**case, "error": f"{type(exc).__name__}: {exc}"})
    return rows
