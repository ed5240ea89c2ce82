"""Serving metrics of one benchmark cell, named and defined as ``vllm bench serve`` does. Pure functions.

Per request (times in seconds on one monotonic clock):

- TTFT = first token time − send time;
- e2e latency (E2EL) = end time − send time;
- TPOT = (E2EL − TTFT) / (output tokens − 1), only for requests with more than one output token;
- ITL = differences between consecutive streamed chunks' arrival times, pooled over all requests. A chunk
  may carry several tokens (speculative decoding), so mean ITL ≥ TPOT there, as in vLLM.

Over the cell: mean, median and p99 of each (reported in ms: ``mean_ttft_ms``, ``median_ttft_ms``,
``p99_ttft_ms``, ...), percentiles by linear interpolation between closest ranks (numpy's default
``method="linear"``: the q-th percentile of sorted ``x[0..n-1]`` sits at index ``(n−1)·q/100``); request,
output-token and total-token (prompt + output) throughput over the cell's wall time; failed requests are
counted and left out of every metric. Comm per output token from CommCounter snapshots before and after.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """One request of a cell. Times in seconds on one clock; ``token_times_s``: arrival time of every
    streamed chunk, the first included (so ``token_times_s[0] == first_token_s``)."""

    send_s: float
    first_token_s: float
    token_times_s: tuple[float, ...]
    end_s: float
    output_tokens: int
    prompt_tokens: int
    ok: bool = True
    error: str = ""

    def __post_init__(self) -> None:
        if not self.ok:
            return
        times = self.token_times_s
        if self.first_token_s < self.send_s or self.end_s < self.first_token_s:
            raise ValueError(f"times out of order: send {self.send_s}, first token {self.first_token_s}, "
                             f"end {self.end_s}")
        if times and (times[0] != self.first_token_s or any(b < a for a, b in pairwise(times))
                      or times[-1] > self.end_s):
            raise ValueError("token_times_s must start at first_token_s, never decrease and end by end_s")
        if self.output_tokens < 1:
            raise ValueError(f"a completed request has output_tokens >= 1, got {self.output_tokens}")


def ttft_s(r: RequestRecord) -> float:
    """Time to first token (s)."""
    return r.first_token_s - r.send_s


def e2el_s(r: RequestRecord) -> float:
    """End-to-end latency (s)."""
    return r.end_s - r.send_s


def tpot_s(r: RequestRecord) -> float | None:
    """Time per output token after the first (s): ``(E2EL − TTFT) / (output − 1)``; None for one token."""
    if r.output_tokens < 2:
        return None
    return (e2el_s(r) - ttft_s(r)) / (r.output_tokens - 1)


def itls_s(r: RequestRecord) -> list[float]:
    """Inter-chunk latencies (s) of one request."""
    return [b - a for a, b in pairwise(r.token_times_s)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy ``method="linear"``)."""
    if not len(values):
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="linear"))


def describe(values: Sequence[float], percentiles: Iterable[float] = (99.0,)) -> dict[str, float | None]:
    """``{"mean", "median", "p99", ...}`` of ``values`` in their own unit; None each when empty."""
    keys = ["mean", "median", *(f"p{q:g}" for q in percentiles)]
    if not len(values):
        return dict.fromkeys(keys)
    out = {"mean": float(np.mean(values)), "median": percentile(values, 50)}
    out.update({f"p{q:g}": percentile(values, q) for q in percentiles})
    return out


def summarize_requests(records: Sequence[RequestRecord], duration_s: float | None = None,
                       percentiles: Iterable[float] = (99.0,)) -> dict:
    """Metrics of a cell, ``vllm bench serve`` names: ``completed``, ``failed``, ``duration_s``,
    ``total_input_tokens``, ``total_output_tokens``, ``request_throughput`` (req/s), ``output_throughput``
    and ``total_token_throughput`` (tok/s), and ``{mean,median,p99}_{ttft,tpot,itl,e2el}_ms``.

    ``duration_s``: the cell's wall time; default last end − first send over all records (failed included)."""
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.ok]
    if duration_s is None:
        duration_s = max(r.end_s for r in records) - min(r.send_s for r in records) if records else 0.0
    series = {
        "ttft": [ttft_s(r) for r in ok],
        "tpot": [t for t in map(tpot_s, ok) if t is not None],
        "itl": [x for r in ok for x in itls_s(r)],
        "e2el": [e2el_s(r) for r in ok],
    }
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
           "total_input_tokens": n_in, "total_output_tokens": n_out, "request_throughput": rate(len(ok)),
           "output_throughput": rate(n_out), "total_token_throughput": rate(n_in + n_out)}
    for name in METRICS:
        for stat, v in describe(series[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = None if v is None else v * 1e3
    return out


def comm_delta(before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]]) -> dict:
    """``after − before`` of two ``CommCounter.snapshot()`` dicts (``{"group/op": {"calls", "bytes"}}``);
    a key missing from ``before`` counts from zero. A decrease means the counter was reset in between."""
    out = {}
    for key, a in after.items():
        b = before.get(key, {"calls": 0, "bytes": 0})
        d = {"calls": a["calls"] - b["calls"], "bytes": a["bytes"] - b["bytes"]}
        if d["calls"] < 0 or d["bytes"] < 0:
            raise ValueError(f"comm counter for {key} went down between snapshots (reset?)")
        if d["calls"] or d["bytes"]:
            out[key] = d
    return out


def comm_per_output_token(before: Mapping, after: Mapping, output_tokens: int) -> dict:
    """Comm calls and bytes per output token of a cell from CommCounter snapshots taken before and after it:
    ``{"calls_per_token", "bytes_per_token", "calls", "bytes", "per_op": {"group/op": {"calls", "bytes",
    "calls_per_token", "bytes_per_token"}}}``. The counter is one rank's (rank 0: what it contributes)."""
    if output_tokens <= 0:
        raise ValueError(f"output_tokens must be > 0, got {output_tokens}")
    delta = comm_delta(before, after)
    per_op = {k: {**v, "calls_per_token": v["calls"] / output_tokens, "bytes_per_token": v["bytes"] / output_tokens}
              for k, v in delta.items()}
    calls, nbytes = sum(v["calls"] for v in delta.values()), sum(v["bytes"] for v in delta.values())
    return {"calls_per_token": calls / output_tokens, "bytes_per_token": nbytes / output_tokens,
            "calls": calls, "bytes": nbytes, "per_op": per_op}


def decode_step_time_s(tpot: float, tau: float = 1.0) -> float:
    """Decode step time (s) behind a TPOT (s): each step emits ``tau`` tokens per sequence (1 without
    speculative decoding), so a step takes ``TPOT·τ``."""
    return tpot * tau
