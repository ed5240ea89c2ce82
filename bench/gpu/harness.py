"""What every GPU check shares: the one timer (CUDA events on a GPU, wall time in the CPU dry runs), the device
copy bandwidth that memory-bound rows are compared with, the dense matmul rate that compute-bound rows are, and a
budgeted loop over cases that keeps failing rows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.gpu.power import PowerMeter


def _event_s(fn: Callable[[], object]) -> float:
    """Seconds of one ``fn()`` between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_s(fn: Callable[[], object]) -> float:
    """Wall seconds of one ``fn()`` (off CUDA a call has finished when it returns)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cuda_time_s(fn: Callable[[], object], iters: int | None = None, warmup: int | None = None,
                device: torch.device | str = "cuda") -> float:
    """Median seconds per call of ``fn()`` over ``iters`` calls after ``warmup`` calls. On a CUDA ``device``:
    CUDA events around each call (on that device's current stream), by default 20 calls after 3; off CUDA (the
    CPU dry runs): the wall time of each call, by default 2 calls after 1."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    iters = iters if iters is not None else 20 if cuda else 2
    warmup = warmup if warmup is not None else 3 if cuda else 1
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        for _ in range(warmup):
            fn()
        times = [_event_s(fn) if cuda else _wall_s(fn) for _ in range(iters)]
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device | str = "cuda", power: PowerMeter | None = None) -> float:
    """Bytes moved (read + write, so twice the copy's size) per second by a device-to-device copy: 4 GiB on CUDA
    (:func:`cuda_time_s`, 10 calls after 3), 64 MiB elsewhere (the CPU dry runs: 3 calls after 1). ``power``:
    also measures NVML power while the copy repeats (phase ``copy 4 GiB``)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    src = torch.empty(2**32 if cuda else 2**26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_time_s(lambda: dst.copy_(src), iters=10 if cuda else 3, device=device)
    if power is not None:
        power.measure(f"copy {src.numel() / 2**30:g} GiB", lambda: dst.copy_(src))
    return 2 * src.numel() / seconds


def matmul_peak(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of one square ``dtype`` matmul (8192 on CUDA: 1.1 TFLOP a call, :func:`cuda_time_s` 10 calls
    after 3; 256 elsewhere, the CPU dry runs): the dense rate a compute floor is measured against in the same run."""
    device = torch.device(device)
    n = 8192 if device.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / cuda_time_s(lambda: a @ b, iters=10, device=device)


def check_rows(cases: list[dict], check: Callable[..., dict], budget_s: float) -> list[dict]:
    """``check(**case)`` for each case until ``budget_s`` seconds have passed (the rest: ``skipped``). A case that
    raises keeps the error in its row, so one failing shape (a kernel out of shared memory at budget 256, say)
    does not lose the rows of the others."""
    t0, rows = time.time(), []
    for case in cases:
        if time.time() - t0 >= budget_s:
            rows.append({**case, "skipped": "time budget"})
            continue
        try:
            rows.append(check(**case))
        except Exception as exc:  # noqa: BLE001 - recorded in the report, the next case still runs
            rows.append({**case, "error": f"{type(exc).__name__}: {exc}"})
    return rows
