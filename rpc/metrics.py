"""``/metrics`` of the serving process: a Prometheus exporter fed by the engine's step records.

:class:`MetricsExporter` subscribes to ``Engine`` (every step and idle heartbeat's :class:`StepRecord`, on the
engine's thread) and folds each record into plain numbers under one lock — a few microseconds, on the step's clock —
and is itself the ``prometheus_client`` collector that turns them into metric families when scraped (on the metrics
thread). :class:`MetricsServer` answers ``GET /metrics`` on ``server.host:server.metrics_port``. vLLM's names and
labels (``model_name``, ``engine``) for what this engine has, ``switchyard:`` names for the rest (:data:`FAMILIES`;
``docs/metrics.md`` lists every one). The answer is always the 0.0.4 text format: prometheus-client's OpenMetrics
answer escapes the colons in the names (``vllm_...``), and vLLM's dashboards would then find nothing. ``_created``
series are off, as in vLLM.
"""

from __future__ import annotations

import logging
import math
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.utils import floatToGoString

from engine.api import (
    HOST_PHASES,
    IDLE_REASONS,
    LAUNCH_PARTS,
    THROTTLE_REASONS,
    EngineFacts,
    HandOffs,
    KVTier,
    Loads,
    StepRecord,
)

log = logging.getLogger(__name__)

prometheus_client.disable_created_metrics()

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TAU_BUCKETS = tuple(float(n) for n in range(1, 17))
FINISH_REASONS = ("stop", "length", "abort", "error")
WAITING_REASONS = ("capacity", "deferred")  # vLLM's reasons
ENERGY_WINDOW_S = 10.0  # joules per output token over this window
BASE_LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class Family:
    """One metric family: its name on the wire (a counter without ``_total``), type, help, labels beyond
    :data:`BASE_LABELS` and, for a histogram, its buckets."""

    name: str
    kind: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _families(*specs: Family) -> dict[str, Family]:
    return {f.name: f for f in specs}


FAMILIES = _families(
    Family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    Family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    Family("vllm:num_requests_waiting_by_reason", "gauge", "Number of waiting requests by reason: 'capacity' = "
           "waiting for KV blocks or a running slot; 'deferred' = waiting for a shared prefix another request is "
           "prefilling (engine.share_inflight_prefix).", ("reason",)),
    Family("switchyard:num_requests_loading", "gauge", "Number of waiting requests whose KV is being loaded from "
           "elsewhere (a host buffer, a tier or another worker); they also count in vllm:num_requests_waiting."),
    Family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    Family("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    Family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    Family("vllm:external_prefix_cache_queries", "counter", "External prefix cache queries (the tiers below the "
           "device pool: host tier, shared store), in terms of number of queried tokens."),
    Family("vllm:external_prefix_cache_hits", "counter", "External prefix cache hits (the host tier and the shared "
           "store together), in terms of number of cached tokens."),
    Family("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens."),
    Family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    Family("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    Family("vllm:request_success", "counter", "Count of successfully processed requests.", ("finished_reason",)),
    Family("switchyard:empty_turns", "counter", "Chat answers that stopped with neither content nor a tool call "
           "after the thought's close (or without closing it); docs/metrics.md."),
    Family("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
           buckets=TTFT_BUCKETS),
    Family("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
           buckets=ITL_BUCKETS),
    Family("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts."),
    Family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
    Family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens."),
    Family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
           ("position",)),
    Family("switchyard:idle_seconds", "counter", "Seconds the GPUs could have done more, by why not "
           "(docs/metrics.md): no_work, blocked_kv, admission_limit, host_bound, draining.", ("reason",)),
    Family("switchyard:steps", "counter", "Engine steps by kind.", ("kind",)),
    Family("switchyard:step_host_seconds", "histogram", "Rank 0's host seconds per step (the Engine.step calls "
           "that finished it).", ("kind",), STEP_BUCKETS),
    Family("switchyard:step_device_seconds", "histogram", "Rank 0's device span per step (CUDA events around its "
           "launch; absent off CUDA).", ("kind",), STEP_BUCKETS),
    Family("switchyard:step_host_phase_seconds", "counter", "Rank 0's host seconds by phase of Engine.step (draft "
           "and target split launch).", ("phase",)),
    Family("switchyard:cuda_graph_replays", "counter", "Steps that replayed a CUDA graph, by kind and rank.",
           ("kind", "rank")),
    Family("switchyard:eager_steps", "counter", "Steps that ran eagerly, by kind, reason and rank.",
           ("kind", "reason", "rank")),
    Family("switchyard:comm_bytes", "counter", "Bytes rank 0 contributed to collectives, by group and op.",
           ("group", "op")),
    Family("switchyard:comm_calls", "counter", "Collectives rank 0 entered, by group and op.", ("group", "op")),
    Family("switchyard:kv_tier_hit_tokens", "counter", "Prompt tokens admissions took from a KV tier.", ("tier",)),
    Family("switchyard:kv_tier_blocks", "gauge", "Blocks a KV tier of this worker holds (cached): device and "
           "host; the shared store's size is its master's to report.", ("tier",)),
    Family("switchyard:kv_tier_bytes", "counter", "Bytes copied into the device pool from a tier (load) and out of "
           "it into the tier (store), over every rank.", ("tier", "direction")),
    Family("switchyard:kv_tier_seconds", "counter", "Seconds rank 0's copy thread spent on a tier's loads and "
           "stores.", ("tier", "direction")),
    Family("switchyard:kv_store_errors", "counter", "The shared KV store's failed calls on rank 0 by reason "
           "(timeout, unreachable, checksum, missing, rejected) and loads that failed on some rank (load_failed).",
           ("reason",)),
    Family("switchyard:pd_kv_blocks_received", "counter", "KV blocks a decode worker read from prefill workers."),
    Family("switchyard:pd_kv_bytes", "counter", "Bytes a decode worker read from prefill workers, over every rank.",
           ("direction",)),
    Family("switchyard:pd_transfer_seconds", "counter", "Seconds rank 0's copy thread spent reading hand-offs."),
    Family("switchyard:pd_prompt_tokens_recomputed", "counter", "Prompt tokens a decode worker computed beyond each "
           "handed-off request's last one (0 while every hand-off delivers)."),
    Family("switchyard:pd_transfer_failures", "counter", "Hand-off reads that failed, by reason (unreachable, "
           "checksum, layout); their requests computed the tokens.", ("reason",)),
    Family("switchyard:pd_leased_blocks", "gauge", "KV blocks a prefill worker holds for decode workers to read."),
    Family("switchyard:pd_leases_ended", "counter", "Prefill leases ended: released by a decode worker or smg, "
           "expired, or reclaimed unread when the prefill pool ran short.", ("how",)),
    Family("switchyard:eplb_balancedness", "gauge", "Mean over max tokens per EP rank of the expert balancer's last "
           "window, at the placement it ran on, per MoE layer (1 = even).", ("layer",)),
    Family("switchyard:eplb_rebalances", "counter", "Placements the expert balancer computed."),
    Family("switchyard:eplb_moved_bytes", "counter", "Expert weight bytes the ranks sent to each other."),
    Family("switchyard:eplb_rebalance_seconds", "counter", "Seconds steps waited for expert moves."),
    Family("switchyard:kv_blocks", "gauge", "KV blocks per attention-DP rank, disjoint states adding up to the "
           "pool: used (referenced, leases included), cached (unreferenced, in the prefix index: evictable), free "
           "(empty).", ("dp_rank", "state")),
    Family("switchyard:acceptance_length", "histogram", "Committed tokens per speculative request per step (tau, "
           "bonus included).", buckets=TAU_BUCKETS),
    Family("switchyard:gpu_power_watts", "gauge", "Power drawn by the rank's GPU (NVML, a 1 s average).", ("rank",)),
    Family("switchyard:gpu_power_limit_watts", "gauge", "The GPU's enforced power limit.", ("rank",)),
    Family("switchyard:gpu_energy_joules", "counter", "Energy the rank's GPU drew while serving (NVML's counter).",
           ("rank",)),
    Family("switchyard:gpu_sm_clock_hertz", "gauge", "SM clock.", ("rank",)),
    Family("switchyard:gpu_kernel_active_ratio", "gauge", "Share of time any kernel ran (NVML utilization.gpu: 1 "
           "for a memory-bound GPU too).", ("rank",)),
    Family("switchyard:gpu_sm_active_ratio", "gauge", "Share of SMs busy (GPM).", ("rank",)),
    Family("switchyard:gpu_tensor_active_ratio", "gauge", "Share of time SMs ran tensor ops (GPM).", ("rank",)),
    Family("switchyard:gpu_dram_active_ratio", "gauge", "DRAM bandwidth used over its peak (GPM).", ("rank",)),
    Family("switchyard:gpu_throttle_reason", "gauge", "1 while the GPU's clocks are held back for this reason "
           "(NVML clock event reasons).", ("rank", "reason")),
    Family("switchyard:energy_per_output_token_joules", "gauge", "Joules all GPUs drew per generated token over the "
           f"last {ENERGY_WINDOW_S:g} s (NaN: no tokens)."),
    Family("switchyard:cpu_utilisation_ratio", "gauge", "CPU time of the rank's process over wall time (above 1 "
           "with several busy threads); exported where there is no GPU.", ("rank",)),
    Family("switchyard:host_cpu_utilisation_ratio", "gauge", "Busy share of the host's CPUs (/proc/stat), as rank "
           "0's host sees it."),
)
# a GPU sample's keys → (family, scale)
GPU_GAUGES = {"power_w": ("switchyard:gpu_power_watts", 1.0),
              "power_limit_w": ("switchyard:gpu_power_limit_watts", 1.0),
              "sm_clock_mhz": ("switchyard:gpu_sm_clock_hertz", 1e6),
              "kernel_active_pct": ("switchyard:gpu_kernel_active_ratio", 0.01),
              "sm_active_pct": ("switchyard:gpu_sm_active_ratio", 0.01),
              "tensor_active_pct": ("switchyard:gpu_tensor_active_ratio", 0.01),
              "dram_active_pct": ("switchyard:gpu_dram_active_ratio", 0.01)}


class MetricsExporter:
    """The metrics of one serving process. ``draft_positions``: speculative positions per draft (the speculation's
    ``draft_rows``; 0: speculation off, no ``vllm:spec_decode_*`` metrics); ``drafted_per_step``: draft tokens per
    request per speculative step (the tree's nodes, root excluded). A family appears once it has a sample: the GPU
    ones only with GPU samples, the CPU ones only without."""

    def __init__(self, model_name: str, *, draft_positions: int = 0, drafted_per_step: int = 0):
        self.base = (model_name, "0")
        self.draft_positions, self.drafted_per_step = draft_positions, drafted_per_step
        self._lock = threading.Lock()
        self._live: Callable[[], Loads] | None = None  # follow()
        # family → {extra label values: value}; a histogram's value: [count per bucket..., +Inf count, sum]
        self._data: dict[str, dict[tuple, float | list]] = {name: {} for name in FAMILIES}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "switchyard:num_requests_loading",
                     "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                     "vllm:prompt_tokens_cached", "vllm:num_preemptions", "vllm:prompt_tokens",
                     "vllm:generation_tokens", "switchyard:empty_turns"):
            self._data[name][()] = 0.0
        self._data["vllm:num_requests_waiting_by_reason"] = {(r,): 0.0 for r in WAITING_REASONS}
        self._data["vllm:request_success"] = {(r,): 0.0 for r in FINISH_REASONS}
        self._data["switchyard:idle_seconds"] = {(r,): 0.0 for r in IDLE_REASONS}
        self._data["switchyard:step_host_phase_seconds"] = {(p,): 0.0 for p in HOST_PHASES + LAUNCH_PARTS}
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
            self._data[name][()] = [0] * (len(FAMILIES[name].buckets) + 1) + [0.0]
        if draft_positions:
            for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                         "vllm:spec_decode_num_accepted_tokens"):
                self._data[name][()] = 0.0
            self._data["vllm:spec_decode_num_accepted_tokens_per_pos"] = {(str(p),): 0.0
                                                                           for p in range(draft_positions)}
        self._energy: dict[int, float] = {}  # rank → last energy reading (mJ)
        self._window: deque[tuple[float, float, int]] = deque()  # (t, joules, tokens) per record
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ---- the subscriber (engine thread) ---------------------------------------------------------------------
    def observe(self, r: StepRecord) -> None:
        """Folds one record into the numbers (the engine's thread, once per step and idle heartbeat)."""
        with self._lock:
            d = self._data
            for reason, seconds in r.idle_s.items():
                d["switchyard:idle_seconds"][(reason,)] += seconds
            self._scheduler(d, r)
            self._requests(r)
            for key, (calls, nbytes) in r.comm.items():
                _add(d["switchyard:comm_calls"], key, calls)
                _add(d["switchyard:comm_bytes"], key, nbytes)
            if r.telemetry:
                self._telemetry(d, r)
            if r.eplb is not None:
                self._eplb(d, r.eplb)
            if r.kind is not None:
                self._step(d, r)

    def follow(self, loads: Callable[[], Loads]) -> None:
        """Read the scheduler gauges (running, waiting, loading, KV usage and blocks) and the KV tiers' figures from
        ``loads()`` — what the engine publishes after every request it runs (an add, an abort, a flush) and every
        step — at each scrape, so they move with the engine rather than at the next step record."""
        self._live = loads

    def _scheduler(self, d: dict, r: StepRecord) -> None:
        if self._live is None:
            self._gauges(d, r.kv)
        t = r.tokens
        d["vllm:prefix_cache_queries"][()] += t.prompt_queried
        d["vllm:prefix_cache_hits"][()] += t.prompt_cached
        d["vllm:num_preemptions"][()] += r.preemptions
        d["vllm:generation_tokens"][()] += t.generated

    @staticmethod
    def _gauges(d: dict, per_dp: tuple) -> None:
        """The scheduler gauges from per attention-DP rank ``RankLoad`` figures."""
        running, waiting, deferred, loading, used, total = 0, 0, 0, 0, 0, 0
        blocks = d["switchyard:kv_blocks"]
        for dp, k in enumerate(per_dp):
            running, waiting, deferred = running + k.running, waiting + k.waiting, deferred + k.deferred
            loading += k.loading
            used, total = used + k.blocks_used, total + k.blocks_total
            label = str(dp)
            blocks[(label, "used")], blocks[(label, "cached")], blocks[(label, "free")] = \
                k.blocks_used, k.blocks_free - k.blocks_empty, k.blocks_empty  # disjoint: they add up to the pool
        d["vllm:num_requests_running"][()] = running
        d["vllm:num_requests_waiting"][()] = waiting
        by_reason = d["vllm:num_requests_waiting_by_reason"]
        by_reason[("capacity",)], by_reason[("deferred",)] = waiting - deferred - loading, deferred
        d["switchyard:num_requests_loading"][()] = loading
        d["vllm:kv_cache_usage_perc"][()] = used / total if total else 0.0

    @staticmethod
    def _tiers(d: dict, tiers: tuple[KVTier, ...]) -> None:
        """The KV tiers' totals (``Loads.tiers``): hits and blocks per tier, the host tier's copies and vLLM's
        external prefix cache counters from it."""
        external = [t for t in tiers if t.tier != "device"]
        if external:  # asked for: what the first tier below the device pool was asked; hit: what any served
            d["vllm:external_prefix_cache_queries"][()] = external[0].queried_tokens
            d["vllm:external_prefix_cache_hits"][()] = sum(t.hit_tokens for t in external)
        for t in tiers:
            d["switchyard:kv_tier_hit_tokens"][(t.tier,)] = t.hit_tokens
            if t.blocks is not None:  # the shared store's size is its master's to report
                d["switchyard:kv_tier_blocks"][(t.tier,)] = t.blocks
            if t.tier == "device":
                continue
            for direction, nbytes, seconds in (("load", t.load_bytes, t.load_s), ("store", t.store_bytes, t.store_s)):
                d["switchyard:kv_tier_bytes"][(t.tier, direction)] = nbytes
                d["switchyard:kv_tier_seconds"][(t.tier, direction)] = seconds
            for reason, n in t.errors.items():
                d["switchyard:kv_store_errors"][(reason,)] = n

    @staticmethod
    def _eplb(d: dict, figures: dict) -> None:
        """The expert balancer's figures (``StepRecord.eplb``): totals, and the last window's balancedness."""
        d["switchyard:eplb_rebalances"][()] = figures["rebalances"]
        d["switchyard:eplb_moved_bytes"][()] = figures["moved_bytes"]
        d["switchyard:eplb_rebalance_seconds"][()] = figures["move_seconds"]
        for layer, b in enumerate(figures["balancedness"] or ()):
            d["switchyard:eplb_balancedness"][(str(layer),)] = b

    @staticmethod
    def _hand_offs(d: dict, h: HandOffs) -> None:
        """The prefill/decode hand-offs' totals (``Loads.hand_offs``)."""
        d["switchyard:pd_kv_blocks_received"][()] = h.received_blocks
        d["switchyard:pd_kv_bytes"][("received",)] = h.received_bytes
        d["switchyard:pd_transfer_seconds"][()] = h.seconds
        d["switchyard:pd_prompt_tokens_recomputed"][()] = h.recomputed_tokens
        for reason, n in h.failures.items():
            d["switchyard:pd_transfer_failures"][(reason,)] = n
        d["switchyard:pd_leased_blocks"][()] = h.leased_blocks
        d["switchyard:pd_leases_ended"][("released",)] = h.leases_released
        d["switchyard:pd_leases_ended"][("expired",)] = h.leases_expired
        d["switchyard:pd_leases_ended"][("reclaimed",)] = h.leases_reclaimed

    def _requests(self, r: StepRecord) -> None:
        q, d = r.requests, self._data
        d["vllm:prompt_tokens"][()] += q.first_prompt_tokens
        d["vllm:prompt_tokens_cached"][()] += q.first_cached_tokens
        for s in q.ttft_s:
            self._hist("vllm:time_to_first_token_seconds", (), s)
        for s in q.itl_s:
            self._hist("vllm:inter_token_latency_seconds", (), s)
        success = d["vllm:request_success"]
        for end in q.ended:
            reason = end.finish_reason if (end.finish_reason,) in success else "error"
            success[(reason,)] += 1
            d["switchyard:empty_turns"][()] += end.empty_turn
            self._hist("vllm:e2e_request_latency_seconds", (), end.e2e_s)
            self._hist("vllm:request_queue_time_seconds", (), end.queue_s)

    def _step(self, d: dict, r: StepRecord) -> None:
        kind = (str(r.kind),)
        _add(d["switchyard:steps"], kind, 1)
        host = r.host_ms
        self._hist("switchyard:step_host_seconds", kind, sum(host[p] for p in HOST_PHASES) / 1e3)
        phases = d["switchyard:step_host_phase_seconds"]
        for phase, ms in host.items():
            phases[(phase,)] += ms / 1e3
        if r.device_ms is not None:
            self._hist("switchyard:step_device_seconds", kind, r.device_ms / 1e3)
        replays, eager = d["switchyard:cuda_graph_replays"], d["switchyard:eager_steps"]
        for rank, coverage in enumerate(r.graphs):
            for k, (replayed, reason) in coverage.items():
                if replayed:
                    _add(replays, (str(k), str(rank)), 1)
                else:
                    _add(eager, (str(k), reason, str(rank)), 1)
        if self.draft_positions and r.accepted:
            n, accepted = len(r.accepted), r.accepted
            d["vllm:spec_decode_num_drafts"][()] += n
            d["vllm:spec_decode_num_draft_tokens"][()] += n * self.drafted_per_step
            d["vllm:spec_decode_num_accepted_tokens"][()] += sum(accepted)
            per_pos = d["vllm:spec_decode_num_accepted_tokens_per_pos"]
            for p in range(min(max(accepted), self.draft_positions)):
                per_pos[(str(p),)] += sum(a > p for a in accepted)
            for a in accepted:
                self._hist("switchyard:acceptance_length", (), a + 1)

    def _hist(self, name: str, key: tuple, value: float) -> None:
        buckets, series = FAMILIES[name].buckets, self._data[name]
        h = series.get(key)
        if h is None:
            h = series[key] = [0] * (len(buckets) + 1) + [0.0]
        h[bisect_left(buckets, value)] += 1
        h[-1] += value

    # ---- telemetry ------------------------------------------------------------------------------------------
    def _telemetry(self, d: dict, r: StepRecord) -> None:
        joules = 0.0
        for rank, sample in r.telemetry.items():
            label = (str(rank),)
            if "gpus" in sample:
                g = sample["gpus"][0] if sample["gpus"] else {}
                for key, (name, scale) in GPU_GAUGES.items():
                    if key in g:
                        d[name][label] = g[key] * scale
                if "throttle_reasons" in g:
                    throttle = d["switchyard:gpu_throttle_reason"]
                    for reason in THROTTLE_REASONS:
                        throttle[(label[0], reason)] = float(reason in g["throttle_reasons"])
                if "energy_mj" in g:
                    prev = self._energy.get(rank)
                    drawn = (g["energy_mj"] - prev) / 1000 if prev is not None and g["energy_mj"] >= prev else 0.0
                    _add(d["switchyard:gpu_energy_joules"], label, drawn)  # from 0 at the first sample
                    self._energy[rank], joules = g["energy_mj"], joules + drawn
            elif "cpu_total_pct" in sample:
                d["switchyard:cpu_utilisation_ratio"][label] = sample.get("process_cpu_pct", 0.0) / 100
                if rank == 0:
                    d["switchyard:host_cpu_utilisation_ratio"][()] = sample["cpu_total_pct"] / 100
        if d["switchyard:gpu_energy_joules"]:
            self._energy_per_token(d, r.t_end, joules, r.tokens.generated)

    def _energy_per_token(self, d: dict, now: float, joules: float, tokens: int) -> None:
        self._window.append((now, joules, tokens))
        while self._window and self._window[0][0] < now - ENERGY_WINDOW_S:
            self._window.popleft()
        total_j, total_tokens = sum(w[1] for w in self._window), sum(w[2] for w in self._window)
        d["switchyard:energy_per_output_token_joules"][()] = total_j / total_tokens if total_tokens else math.nan

    # ---- the collector (metrics thread) ---------------------------------------------------------------------
    def collect(self):
        """``prometheus_client``'s collector protocol: every family that has a sample."""
        live = self._live() if self._live is not None else None
        with self._lock:
            if live is not None:
                self._gauges(self._data, live.per_dp)
                self._tiers(self._data, live.tiers)
                self._hand_offs(self._data, live.hand_offs)
            snapshot = {name: {k: list(v) if isinstance(v, list) else v for k, v in series.items()}
                        for name, series in self._data.items() if series}
        for name, series in snapshot.items():
            f = FAMILIES[name]
            labels = [*BASE_LABELS, *f.labels]
            if f.kind == "histogram":
                family = HistogramMetricFamily(name, f.doc, labels=labels)
                bounds = [floatToGoString(b) for b in f.buckets] + ["+Inf"]
                for key, h in series.items():
                    cumulative, total = [], 0
                    for count in h[:-1]:
                        total += count
                        cumulative.append(total)
                    family.add_metric([*self.base, *key], list(zip(bounds, cumulative, strict=True)), h[-1])
            else:
                family = (CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily)(name, f.doc,
                                                                                            labels=labels)
                for key, value in series.items():
                    family.add_metric([*self.base, *key], value)
            yield family

    def text(self) -> bytes:
        """The 0.0.4 text exposition (the names keep their colons)."""
        return generate_latest(self.registry)


def _add(series: dict, key: tuple, value: float) -> None:
    series[key] = series.get(key, 0.0) + value


class MetricsServer:
    """``GET /metrics`` → :meth:`MetricsExporter.text` on ``host:port`` (0: a free port), on daemon threads."""

    def __init__(self, exporter: MetricsExporter, host: str, port: int):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics here")
                    return
                body = exporter.text()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):  # noqa: A002 - scrapes are not logged
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as err:
            raise RuntimeError(f"could not bind the metrics endpoint {host}:{port} (server.metrics_port; null turns "
                               f"it off): {err}") from err
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def exporter_for(facts: EngineFacts, model_name: str) -> MetricsExporter:
    """The exporter of an engine with ``facts``, its spec-decode metrics shaped by the speculation."""
    return MetricsExporter(model_name, draft_positions=facts.draft_positions, drafted_per_step=facts.drafted_per_step)
