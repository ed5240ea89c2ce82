"""Background telemetry (NVML through ``nvidia-ml-py``, or CPU utilisation) and the per-cell verdict.

:class:`TelemetrySampler` runs a daemon thread that takes one sample every ``interval_s`` seconds and keeps
them as plain dicts. With NVML and at least one GPU a sample is
``{"t": s, "gpus": [{"index", "power_w", "power_limit_w", "power_pct", "energy_mj", "sm_clock_mhz",
"mem_clock_mhz", "kernel_active_pct", "sm_active_pct", "sm_occupancy_pct", "dram_active_pct"}, ...]}``;
a metric the device refuses is left out and the reason is kept in ``missing``. ``kernel_active_pct`` is
NVML's ``utilization.gpu``: it only says *a* kernel was running, so a memory-bound GPU reads 100 %. The
SM and DRAM activity come from GPM (Hopper or newer), averaged over the interval between two samples.
Without NVML or a GPU a sample is ``{"t": s, "cpu_total_pct": %, "cpu_pct": [% per core]}`` from
``/proc/stat`` deltas, and ``reason`` says why ("no NVML/GPU: ...").

:func:`verdict` classifies a cell as bound by memory, compute, interconnect or host/launch overhead from its
measured step time against the floors of :func:`compute_floors` (see bench/cost/formulas.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from itertools import pairwise

from bench.cost.formulas import Floors, step_floors
from bench.cost.hardware import Hardware
from bench.cost.shapes import ModelShape
from parallelism import nvml as nvml_lib

log = logging.getLogger(__name__)

GPU_METRICS = ("power_w", "power_pct", "sm_clock_mhz", "mem_clock_mhz", "kernel_active_pct", "sm_active_pct",
               "sm_occupancy_pct", "dram_active_pct")


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
    """CPU utilisation from ``/proc/stat`` deltas between consecutive samples."""

    source = "cpu"

    def __init__(self, reason: str = "no NVML/GPU", stat_path: str = "/proc/stat"):
        self.reason, self.stat_path = reason, stat_path
        self.missing = {m: reason for m in GPU_METRICS}
        self._prev = self._read()

    def _read(self) -> dict[str, tuple[int, int]]:
        with open(self.stat_path) as f:
            return parse_proc_stat(f.read())

    def sample(self) -> dict:
        cur = self._read()
        out = cpu_utilisation(self._prev, cur)
        self._prev = cur
        return out

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- NVML side
class NvmlBackend:
    """Per-GPU power, energy counter, clocks, utilisation and GPM activity. Every NVML call is guarded: a
    metric that fails once is recorded in ``missing[metric]`` (with the GPU and NVML's message) and not asked
    for again. NVML numbers GPUs by PCI bus order whatever ``CUDA_VISIBLE_DEVICES`` says; ``indices`` picks
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
            for m in ("sm_active_pct", "sm_occupancy_pct", "dram_active_pct"):
                self.missing.setdefault(m, why)
            return None
        samples = [self._try(gpu, "gpm", nv.nvmlGpmSampleAlloc) for _ in range(2)]
        if None in samples or self._try(gpu, "gpm", nv.nvmlGpmSampleGet, handle, samples[0]) is None:
            for m in ("sm_active_pct", "sm_occupancy_pct", "dram_active_pct"):
                self.missing.setdefault(m, self.missing.get("gpm", f"gpu{gpu}: GPM sample failed"))
            return None
        return samples

    def _gpm_read(self, gpu: int, slot: int, handle) -> dict:
        nv, pair = self.nvml, self._gpm[slot]
        if pair is None or self._try(gpu, "gpm", nv.nvmlGpmSampleGet, handle, pair[1]) is None:
            return {}
        ids = {"sm_active_pct": nv.NVML_GPM_METRIC_SM_UTIL, "sm_occupancy_pct": nv.NVML_GPM_METRIC_SM_OCCUPANCY,
               "dram_active_pct": nv.NVML_GPM_METRIC_DRAM_BW_UTIL}
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


class TelemetrySampler:
    """Samples ``backend`` every ``interval_s`` seconds on a daemon thread; ``with`` starts and stops it.

    ``mark()`` returns the current sample count so a caller can summarise one cell with ``summary(since=mark)``.
    At most ``max_samples`` are kept (oldest dropped)."""

    def __init__(self, interval_s: float = 0.2, backend=None, max_samples: int = 100_000):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s, self.max_samples = interval_s, max_samples
        self.backend = backend if backend is not None else open_backend()
        self._samples: list[dict] = []
        self._dropped = 0
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
            except Exception as err:  # never kill the benchmark over telemetry
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

    @property
    def samples(self) -> list[dict]:
        with self._lock:
            return list(self._samples)

    def summary(self, since: int = 0) -> dict:
        """:func:`summarize` over the samples taken since ``mark()`` returned ``since``."""
        with self._lock:
            window = self._samples[max(0, since - self._dropped):]
        out = summarize(window)
        out.update(source=self.source, reason=self.reason, missing=self.missing)
        return out


def power_during(backend: NvmlBackend, run: Callable[[], object], seconds: float,
                 sync: Callable[[], None]) -> dict:
    """Runs ``run()`` back to back for at least ``seconds`` (``sync`` waits for the device) and returns what the
    backend's first GPU drew meanwhile: ``mean_w`` from the energy counter's delta over the span (NVML's power
    reading is itself a 1 s average on Ampere and newer, so it cannot resolve a short span; ``last_1s_w`` is
    that reading at the end), ``pct_of_limit``, clocks at the end and GPM SM/DRAM activity over the span."""
    sync()
    first = {"t": time.monotonic(), **backend.sample()}
    calls = 0
    while time.monotonic() - first["t"] < seconds:
        run()
        calls += 1
    sync()
    last = {"t": time.monotonic(), **backend.sample()}
    g0, g1 = first["gpus"][0], last["gpus"][0]
    span = last["t"] - first["t"]
    row = {"seconds": span, "calls": calls}
    if "energy_mj" in g0 and "energy_mj" in g1:
        row["mean_w"] = (g1["energy_mj"] - g0["energy_mj"]) / 1000 / span
    if "power_w" in g1:
        row["last_1s_w"] = g1["power_w"]
    if "power_limit_w" in g1:
        row["limit_w"] = g1["power_limit_w"]
        if "mean_w" in row:
            row["pct_of_limit"] = 100 * row["mean_w"] / g1["power_limit_w"]
    for m in ("sm_clock_mhz", "mem_clock_mhz", "sm_active_pct", "dram_active_pct"):
        if m in g1:
            row[m] = g1[m]
    return row


# ----------------------------------------------------------------------------------------------- summary
def _stats(values: list[float]) -> dict[str, float] | None:
    return {"mean": sum(values) / len(values), "max": max(values)} if values else None


def summarize(samples: list[dict]) -> dict:
    """Means and maxima of a sample list (GPU metrics pooled over GPUs and samples; ``power_w`` is per GPU).

    GPU: ``energy_j`` sums each GPU's counter delta (last − first sample); where the counter is missing it
    integrates ``power_w`` over time (trapezoid), and ``energy_source`` says which. ``power_w_total_mean``:
    mean of the per-sample sum over GPUs. CPU: ``cpu_total_pct`` and ``cpu_pct_mean`` per core."""
    out: dict = {"num_samples": len(samples),
                 "duration_s": samples[-1]["t"] - samples[0]["t"] if len(samples) > 1 else 0.0}
    if not samples:
        return out
    if "gpus" in samples[0]:
        for m in GPU_METRICS:
            st = _stats([g[m] for s in samples for g in s["gpus"] if m in g])
            if st is not None:
                out[m] = st
        totals = [sum(g["power_w"] for g in s["gpus"] if "power_w" in g) for s in samples]
        out["power_w_total_mean"] = sum(totals) / len(totals)
        out["num_gpus"] = len(samples[0]["gpus"])
        energy, source = 0.0, None
        for idx in range(len(samples[0]["gpus"])):
            series = [(s["t"], s["gpus"][idx]) for s in samples if idx < len(s["gpus"])]
            counter = [(t, g["energy_mj"]) for t, g in series if "energy_mj" in g]
            power = [(t, g["power_w"]) for t, g in series if "power_w" in g]
            if len(counter) > 1:
                energy += (counter[-1][1] - counter[0][1]) / 1000
                source = source or "counter"
            elif len(power) > 1:
                energy += sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in pairwise(power))
                source = "power integral"
        if source:
            out["energy_j"], out["energy_source"] = energy, source
        return out
    st = _stats([s["cpu_total_pct"] for s in samples])
    out["cpu_total_pct"] = st
    cores = [s["cpu_pct"] for s in samples if s.get("cpu_pct")]
    if cores:
        out["cpu_pct_mean"] = [sum(c[i] for c in cores) / len(cores) for i in range(len(cores[0]))]
    return out


def energy_per_token_j(summary: Mapping, output_tokens: int) -> float | None:
    """Joules per output token from a :func:`summarize` result; None without energy data or tokens."""
    if "energy_j" not in summary or output_tokens <= 0:
        return None
    return summary["energy_j"] / output_tokens


# ----------------------------------------------------------------------------------------------- verdict
def compute_floors(model: ModelShape, hw: Hardware, layout, batch: int, context: int,
                   comm_per_step: Mapping[str, Mapping[str, float]] | None = None, tokens_per_seq: int = 1,
                   touched: float | None = None) -> Floors:
    """Floors (s) of one decode step: memory = (weights + KV bytes read) / memory bandwidth; compute =
    FLOPs / peak (2 × active params × tokens + attention); interconnect = Σ α·calls + bytes·factor/link
    bandwidth. ``comm_per_step``: measured ``{"group/op": {"calls", "bytes"}}`` for one step (a CommCounter
    delta / steps); default: the documented per-forward formula with the model's message sizes. ``touched``:
    measured distinct experts per MoE layer per step (else the formula's expectation; ``detail["experts"]``).
    See :func:`bench.cost.formulas.step_floors`; ``layout`` is a Layout or a preset name."""
    return step_floors(layout, hw, model, batch, context, comm_per_step, tokens_per_seq, touched=touched)


def verdict(step_time_s: float, floors: Floors | Mapping[str, float], host_factor: float = 2.0,
            telemetry: Mapping | None = None, basis: str = "serial") -> dict:
    """What bounds a cell whose measured step takes ``step_time_s`` seconds.

    Rule: the floor model explains at most ``explained = max(memory, compute) + interconnect`` (``basis=
    "serial"``, the cost model's overlap assumption) or ``max(memory, compute, interconnect)`` (``basis=
    "largest"``). When ``step_time_s > host_factor × explained`` the time goes somewhere the floors do not
    see: **host/launch** (Python, kernel launches, eager mode, synchronisation). Otherwise the largest floor
    names the bound. ``telemetry`` (a :func:`summarize` result) adds evidence and a consistency check:
    a memory verdict with DRAM activity < 30 %, a compute verdict with SM activity < 30 % or a host verdict
    with SM activity > 80 % is flagged ``telemetry_consistent=False``.

    Returns ``{"bound", "step_time_s", "floors_s", "largest_floor", "largest_floor_s", "explained_s",
    "ratio" (step / explained), "ratio_to_largest", "host_factor", "basis", "explanation", "evidence",
    "telemetry_consistent", "experts"}``; ``experts``: the routed-expert count the memory floor used,
    ``{"per_moe_layer", "source"}`` (``measured`` or ``formula``), None when ``floors`` are plain numbers."""
    if basis not in ("serial", "largest"):
        raise ValueError(f"basis must be 'serial' or 'largest', got {basis!r}")
    f = floors.as_dict() if isinstance(floors, Floors) else dict(floors)
    largest = max(("memory", "compute", "interconnect"), key=lambda k: f[k])
    local = max(f["memory"], f["compute"])
    explained = local + f["interconnect"] if basis == "serial" else max(local, f["interconnect"])
    ratio = step_time_s / explained if explained > 0 else float("inf")
    bound = "host/launch" if ratio > host_factor else largest
    if bound == "host/launch":
        why = (f"step {step_time_s * 1e3:.3f} ms is {ratio:.1f}x the {basis} floor {explained * 1e3:.3f} ms "
               f"(> {host_factor:g}x): time goes to host work / kernel launches the floors do not model")
    else:
        why = (f"step {step_time_s * 1e3:.3f} ms is {ratio:.1f}x the {basis} floor {explained * 1e3:.3f} ms; "
               f"largest floor: {largest} {f[largest] * 1e3:.3f} ms")
    evidence, consistent = _evidence(bound, telemetry)
    return {"bound": bound, "step_time_s": step_time_s, "floors_s": f, "largest_floor": largest,
            "largest_floor_s": f[largest], "explained_s": explained, "ratio": ratio,
            "ratio_to_largest": step_time_s / f[largest] if f[largest] > 0 else float("inf"),
            "host_factor": host_factor, "basis": basis, "explanation": why, "evidence": evidence,
            "telemetry_consistent": consistent,
            "experts": floors.detail.get("experts") if isinstance(floors, Floors) else None}


def _mean(summary: Mapping, key: str) -> float | None:
    v = summary.get(key)
    return v["mean"] if isinstance(v, Mapping) else None


def _evidence(bound: str, telemetry: Mapping | None) -> tuple[list[str], bool | None]:
    if not telemetry:
        return [], None
    ev, consistent = [], None
    dram, sm, power = (_mean(telemetry, k) for k in ("dram_active_pct", "sm_active_pct", "power_pct"))
    busy = _mean(telemetry, "kernel_active_pct")
    cpu = _mean(telemetry, "cpu_total_pct")
    for name, v in (("DRAM active", dram), ("SM active", sm), ("power", power), ("kernel active", busy),
                    ("host CPU", cpu)):
        if v is not None:
            ev.append(f"{name} {v:.0f} %" + (" of limit" if name == "power" else ""))
    if busy is not None and busy > 90 and (sm is None or sm < 50):
        ev.append("utilization.gpu near 100 % only means a kernel was resident, not that SMs were busy")
    if bound == "memory" and dram is not None:
        consistent = dram >= 30
    elif bound == "compute" and sm is not None:
        consistent = sm >= 30
    elif bound == "host/launch" and sm is not None:
        consistent = sm <= 80
    elif bound == "host/launch" and cpu is not None:
        consistent = None
        ev.append("no GPU activity counters: host/launch is inferred from the floors alone")
    if consistent is False:
        ev.append(f"telemetry disagrees with a {bound} verdict")
    if telemetry.get("reason"):
        ev.append(str(telemetry["reason"]))
    return ev, consistent
