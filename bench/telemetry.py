"""Telemetry summaries for the bench and the per-cell verdict.

The samplers live in the runtime (``engine/worker/telemetry.py``: NVML per GPU, or CPU utilisation, on a daemon thread);
the bench samples the whole box with them while a cell runs and summarises the samples here.

:func:`verdict` classifies a cell as bound by memory, compute, interconnect or host/launch overhead from its
measured step time against the floors of :func:`compute_floors` (see bench/cost/formulas.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from itertools import pairwise

from bench.cost.formulas import Floors, step_floors
from bench.cost.hardware import Hardware
from bench.cost.shapes import ModelShape
from engine.worker.telemetry import GPU_METRICS, NvmlBackend, TelemetrySampler


def sampler_summary(sampler: TelemetrySampler, since: int = 0) -> dict:
    """:func:`summarize` over the samples ``sampler`` took since ``mark()`` returned ``since``, with its source, the
    reason for a CPU fallback and the metrics the device refused."""
    out = summarize(sampler.window(since))
    out.update(source=sampler.source, reason=sampler.reason, missing=sampler.missing)
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
