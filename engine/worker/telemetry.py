"""Device telemetry on a sampler thread: NVML (``nvidia-ml-py``) per GPU, or CPU utilisation where there is none.

:class:`TelemetrySampler` takes one sample every ``interval_s`` seconds on a daemon thread — never inside the step
loop — and keeps them as plain dicts. With NVML a sample is ``{"t": s, "gpus": [{"index", "power_w",
"power_limit_w", "power_pct", "energy_mj", "sm_clock_mhz", "mem_clock_mhz", "kernel_active_pct", "sm_active_pct",
"sm_occupancy_pct", "tensor_active_pct", "dram_active_pct", "throttle_reasons"}, ...]}``; a metric the device refuses
is left out and the reason is kept in ``missing``. ``kernel_active_pct`` is NVML's ``utilization.gpu``: it only says
*a* kernel was running, so a memory-bound GPU reads 100 %. SM, tensor and DRAM activity come from GPM (Hopper or
newer), averaged over the interval between two samples; ``throttle_reasons`` lists why the clocks are held back
(:data:`THROTTLE_REASONS`). Without NVML or a GPU a sample is ``{"t": s, "cpu_total_pct": %, "cpu_pct": [% per
core], "process_cpu_pct": %}`` from ``/proc/stat`` deltas and this process's CPU time, and ``reason`` says why.

Each serving rank runs one sampler on its own device (:func:`rank_sampler`); the engine ships each new sample to rank
0 with the step's result gather (``engine.step.RankReport``). ``bench/`` samples the whole box with the same
classes. ``pynvml`` is imported only when a sampler opens NVML.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import torch

from parallelism import nvml as nvml_lib

log = logging.getLogger(__name__)

GPU_METRICS = ("power_w", "power_pct", "sm_clock_mhz", "mem_clock_mhz", "kernel_active_pct", "sm_active_pct",
               "sm_occupancy_pct", "tensor_active_pct", "dram_active_pct")
GPM_METRICS = {"sm_active_pct": "NVML_GPM_METRIC_SM_UTIL", "sm_occupancy_pct": "NVML_GPM_METRIC_SM_OCCUPANCY",
               "tensor_active_pct": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
               "dram_active_pct": "NVML_GPM_METRIC_DRAM_BW_UTIL"}
# NVML's clock event (throttle) reason bits (nvmlClocksEventReason*), by the name the metrics use
THROTTLE_REASONS = {"gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
                    "sync_boost": 0x10, "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80,
                    "display_clocks": 0x100}


# ---------------------------------------------------------------------------------------------- CPU side
def parse_proc_stat(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/stat`` text → ``{"cpu": (busy, total), "cpu0": ..., ...}`` in jiffies; idle = idle + iowait."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *fields = line.split()
        vals = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        total = sum(vals)
        out[name] = (total - idle, total)
    return out


def cpu_utilisation(prev: Mapping[str, tuple[int, int]], cur: Mapping[str, tuple[int, int]]) -> dict:
    """Two :func:`parse_proc_stat` readings → ``{"cpu_total_pct": %, "cpu_pct": [% per core]}``."""
    def pct(name):
        (b0, t0), (b1, t1) = prev[name], cur[name]
        return 100.0 * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    cores = sorted((n for n in cur if n != "cpu" and n in prev), key=lambda n: int(n[3:]))
    return {"cpu_total_pct": pct("cpu"), "cpu_pct": [pct(n) for n in cores]}


class CpuBackend:
    """CPU utilisation from ``/proc/stat`` deltas between consecutive samples, and this process's share (its CPU
    time over the wall time between samples: above 100 % with several busy threads)."""

    source = "cpu"

    def __init__(self, reason: str = "no NVML/GPU", stat_path: str = "/proc/stat"):
        self.reason, self.stat_path = reason, stat_path
        self.missing = {m: reason for m in GPU_METRICS}
        self._prev = self._read()
        self._prev_process = (time.process_time(), time.monotonic())

    def _read(self) -> dict[str, tuple[int, int]]:
        with open(self.stat_path) as f:
            return parse_proc_stat(f.read())

    def sample(self) -> dict:
        cur, process = self._read(), (time.process_time(), time.monotonic())
        out = cpu_utilisation(self._prev, cur)
        (cpu0, t0), (cpu1, t1) = self._prev_process, process
        out["process_cpu_pct"] = 100.0 * (cpu1 - cpu0) / (t1 - t0) if t1 > t0 else 0.0
        self._prev, self._prev_process = cur, process
        return out

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- NVML side
class NvmlBackend:
    """Per-GPU power, energy counter, clocks, throttle reasons, utilisation and GPM activity. Every NVML call is
    guarded: a metric that fails once is recorded in ``missing[metric]`` (with the GPU and NVML's message) and not
    asked for again. NVML numbers GPUs by PCI bus order whatever ``CUDA_VISIBLE_DEVICES`` says; ``indices`` picks
    NVML indices (default: every GPU on the box)."""

    source = "nvml"
    reason = ""

    def __init__(self, nvml, indices: list[int] | None = None):
        self.nvml = nvml
        count = nvml.nvmlDeviceGetCount()
        self.indices = list(range(count)) if indices is None else indices
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        self.missing: dict[str, str] = {}
        self._off: set[tuple[int, str]] = set()
        self._gpm = [self._gpm_init(i, h) for i, h in zip(self.indices, self.handles, strict=True)]

    def _try(self, gpu: int, metric: str, fn, *args):
        if (gpu, metric) in self._off:
            return None
        try:
            return fn(*args)
        except Exception as err:  # NVMLError_NotSupported, NoPermission, a binding without the symbol, ...
            self._off.add((gpu, metric))
            self.missing.setdefault(metric, f"gpu{gpu}: {type(err).__name__}: {err}")
            return None

    def _gpm_init(self, gpu: int, handle):
        """``[prev_sample, spare_sample]`` when GPM works on this GPU, else None with the reason recorded."""
        nv = self.nvml
        support = self._try(gpu, "gpm", nv.nvmlGpmQueryDeviceSupport, handle)
        if support is None or not getattr(support, "isSupportedDevice", 0):
            why = self.missing.get("gpm", f"gpu{gpu}: GPM not supported on this device (Hopper or newer needed)")
            for m in GPM_METRICS:
                self.missing.setdefault(m, why)
            return None
        samples = [self._try(gpu, "gpm", nv.nvmlGpmSampleAlloc) for _ in range(2)]
        if None in samples or self._try(gpu, "gpm", nv.nvmlGpmSampleGet, handle, samples[0]) is None:
            for m in GPM_METRICS:
                self.missing.setdefault(m, self.missing.get("gpm", f"gpu{gpu}: GPM sample failed"))
            return None
        return samples

    def _gpm_read(self, gpu: int, slot: int, handle) -> dict:
        nv, pair = self.nvml, self._gpm[slot]
        if pair is None or self._try(gpu, "gpm", nv.nvmlGpmSampleGet, handle, pair[1]) is None:
            return {}
        ids = {name: getattr(nv, const, None) for name, const in GPM_METRICS.items()}
        ids = {name: mid for name, mid in ids.items() if mid is not None}  # an older binding lacks some
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics, mg.sample1, mg.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, len(ids), pair[0], pair[1]
        for i, mid in enumerate(ids.values()):
            mg.metrics[i].metricId = mid
        out = {}
        if self._try(gpu, "gpm", nv.nvmlGpmMetricsGet, mg) is not None:
            for i, name in enumerate(ids):
                if mg.metrics[i].nvmlReturn == 0:
                    out[name] = float(mg.metrics[i].value)
                else:
                    self.missing.setdefault(name, f"gpu{gpu}: GPM metric returned {mg.metrics[i].nvmlReturn}")
        self._gpm[slot] = [pair[1], pair[0]]  # newest becomes the next interval's start
        return out

    def _throttle(self, gpu: int, handle) -> list[str] | None:
        """The names of the clock event reasons set now (``nvmlDeviceGetCurrentClocksEventReasons``, or its
        older name in bindings without it)."""
        nv = self.nvml
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        bits = self._try(gpu, "throttle_reasons", fn, handle) if fn is not None else None
        if bits is None:
            self.missing.setdefault("throttle_reasons", f"gpu{gpu}: no clock event reasons in this NVML binding")
            return None
        return [name for name, bit in THROTTLE_REASONS.items() if int(bits) & bit]

    def sample(self) -> dict:
        nv, gpus = self.nvml, []
        for slot, (gpu, h) in enumerate(zip(self.indices, self.handles, strict=True)):
            g: dict = {"index": gpu}
            power = self._try(gpu, "power_w", nv.nvmlDeviceGetPowerUsage, h)  # mW
            limit = self._try(gpu, "power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit, h)  # mW
            if power is not None:
                g["power_w"] = power / 1000
            if limit:
                g["power_limit_w"] = limit / 1000
                if power is not None:
                    g["power_pct"] = 100.0 * power / limit
            energy = self._try(gpu, "energy_mj", nv.nvmlDeviceGetTotalEnergyConsumption, h)  # mJ since driver load
            if energy is not None:
                g["energy_mj"] = float(energy)
            for name, clock in (("sm_clock_mhz", nv.NVML_CLOCK_SM), ("mem_clock_mhz", nv.NVML_CLOCK_MEM)):
                mhz = self._try(gpu, name, nv.nvmlDeviceGetClockInfo, h, clock)
                if mhz is not None:
                    g[name] = float(mhz)
            util = self._try(gpu, "kernel_active_pct", nv.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                g["kernel_active_pct"] = float(util.gpu)
            reasons = self._throttle(gpu, h)
            if reasons is not None:
                g["throttle_reasons"] = reasons
            g.update(self._gpm_read(gpu, slot, h))
            gpus.append(g)
        return {"gpus": gpus}

    def close(self) -> None:
        for pair in self._gpm:
            for s in pair or ():
                try:
                    self.nvml.nvmlGpmSampleFree(s)
                except Exception:  # best effort at shutdown
                    pass
        nvml_lib.shutdown(self.nvml)


def open_backend(prefer: str = "auto", nvml=None, indices: list[int] | None = None):
    """NVML when ``nvidia-ml-py`` imports, NVML initialises and a GPU exists (``prefer="auto"``), else the CPU
    backend with the reason; ``prefer="nvml"`` raises instead, ``prefer="cpu"`` forces CPU. ``nvml``: a module
    to use instead of ``pynvml``; ``indices``: NVML GPU indices to sample (default all)."""
    if prefer not in ("auto", "nvml", "cpu"):
        raise ValueError(f"telemetry backend must be auto, nvml or cpu, got {prefer!r}")
    if prefer == "cpu":
        return CpuBackend("no NVML/GPU: CPU backend requested")
    try:
        nvml = nvml_lib.load(nvml)
    except Exception as err:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        reason = f"no NVML/GPU: {type(err).__name__}: {err}"
    else:
        try:
            if nvml.nvmlDeviceGetCount() > 0:
                return NvmlBackend(nvml, indices)
            reason = "no NVML/GPU: NVML found no GPU"
        except Exception as err:
            reason = f"no NVML/GPU: {type(err).__name__}: {err}"
        nvml_lib.shutdown(nvml)
    if prefer == "nvml":
        raise RuntimeError(reason)
    return CpuBackend(reason)


def rank_backend(device: torch.device, nvml=None):
    """The backend of one serving rank: NVML on the GPU that CUDA calls ``device`` (found by UUID,
    :func:`parallelism.nvml.cuda_handle`), else CPU utilisation with the reason."""
    if device.type != "cuda":
        return CpuBackend(f"no NVML/GPU: the rank runs on {device.type}")
    try:
        nv = nvml_lib.load(nvml)
    except Exception as err:  # noqa: BLE001 - no NVML on this box: CPU figures, with the reason
        return CpuBackend(f"no NVML/GPU: {type(err).__name__}: {err}")
    try:
        index = nv.nvmlDeviceGetIndex(nvml_lib.cuda_handle(nv, device.index or 0))
        return NvmlBackend(nv, [index])
    except Exception as err:  # noqa: BLE001 - the device is not in NVML's list (a MIG slice, a remapped UUID)
        nvml_lib.shutdown(nv)
        return CpuBackend(f"no NVML/GPU: {type(err).__name__}: {err}")


class TelemetrySampler:
    """Samples ``backend`` every ``interval_s`` seconds on a daemon thread; ``with`` starts and stops it.

    ``mark()`` returns the current sample count so a caller can summarise one cell (``bench.telemetry.summarize``
    over ``window(since=mark)``); ``fresh()`` returns the newest sample once (the engine's per-step gather). At most
    ``max_samples`` are kept (oldest dropped)."""

    def __init__(self, interval_s: float = 0.2, backend=None, max_samples: int = 100_000):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s, self.max_samples = interval_s, max_samples
        self.backend = backend if backend is not None else open_backend()
        self._samples: list[dict] = []
        self._dropped = 0
        self._handed = 0  # samples taken when fresh() last returned one
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def source(self) -> str:
        return self.backend.source

    @property
    def reason(self) -> str:
        return self.backend.reason

    @property
    def missing(self) -> dict[str, str]:
        return dict(self.backend.missing)

    def sample_now(self) -> dict:
        """Takes one sample (also what the thread does); returns it."""
        s = {"t": time.monotonic(), **self.backend.sample()}
        with self._lock:
            self._samples.append(s)
            if len(self._samples) > self.max_samples:
                self._samples.pop(0)
                self._dropped += 1
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_now()
            except Exception as err:  # never kill the engine or the benchmark over telemetry
                log.warning("telemetry sample failed: %s", err)

    def start(self) -> TelemetrySampler:
        if self._thread is None:
            self.sample_now()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> list[dict]:
        """Stops the thread (one last sample closes the interval) and releases NVML; returns all samples."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample_now()
            self.backend.close()
        return self.samples

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def mark(self) -> int:
        with self._lock:
            return self._dropped + len(self._samples)

    def fresh(self) -> dict | None:
        """The newest sample if no earlier call returned it, else None."""
        with self._lock:
            taken = self._dropped + len(self._samples)
            if taken == self._handed or not self._samples:
                return None
            self._handed = taken
            return self._samples[-1]

    @property
    def samples(self) -> list[dict]:
        with self._lock:
            return list(self._samples)

    def window(self, since: int = 0) -> list[dict]:
        """The samples taken since ``mark()`` returned ``since``."""
        with self._lock:
            return self._samples[max(0, since - self._dropped):]


def rank_sampler(device: torch.device, interval_s: float) -> TelemetrySampler:
    """One serving rank's sampler of its own device (:func:`rank_backend`), keeping only recent samples."""
    return TelemetrySampler(interval_s, rank_backend(device), max_samples=4)
