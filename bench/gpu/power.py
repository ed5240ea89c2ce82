"""NVML power of a GPU (by default the one CUDA calls device 0) while a timed kernel runs back to back."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from bench.telemetry import power_during
from engine.worker.telemetry import NvmlBackend
from parallelism import nvml


class PowerMeter:
    """NVML power of the GPU that CUDA calls ``device`` (default 0; found by UUID:
    :func:`parallelism.nvml.cuda_handle`). ``measure(name, fn)`` runs ``fn`` back to back for ``seconds`` and
    keeps :func:`bench.telemetry.power_during`'s row (``mean_w``: watts): the mean comes from the energy counter,
    since NVML's power value is a 1 s average on Ampere and newer and the timed calls last micro- to
    milliseconds. ``summary()`` also shuts NVML down."""

    def __init__(self, seconds: float = 1.5, device: int = 0):
        self.rows, self.seconds, self.device, self.backend, self.why_not = [], seconds, device, None, None
        nv = None
        try:
            nv = nvml.load()
            self.backend = NvmlBackend(nv, [nv.nvmlDeviceGetIndex(nvml.cuda_handle(nv, device))])
        except Exception as exc:  # noqa: BLE001 - ImportError, or NVML present but no driver/GPU/UUID match
            if nv is not None:
                nvml.shutdown(nv)  # initialised, but no backend to close it
            self.why_not = f"NVML power not measured: {type(exc).__name__}: {exc}"

    def measure(self, name: str, fn: Callable[[], object]) -> dict | None:
        """The row kept for ``fn`` (also returned), or None without NVML."""
        if self.backend is None:
            return None
        sync = functools.partial(torch.cuda.synchronize, self.device)
        self.rows.append(dict(phase=name, **power_during(self.backend, fn, self.seconds, sync)))
        return self.rows[-1]

    def summary(self) -> dict | str:
        if self.backend is None:
            return self.why_not
        missing = dict(self.backend.missing)
        self.backend.close()
        return dict(phases=self.rows, missing=missing)
