"""``/metrics`` of the serving process: a Prometheus exporter fed by the engine's step records.

:class:`MetricsExporter` subscribes to ``Engine`` (every step and idle heartbeat's :class:`StepRecord`, on the
engine thread) and keeps ``prometheus_client`` metrics in a registry of its own; :class:`MetricsServer` answers
``GET /metrics`` on ``server.host:server.metrics_port``. vLLM's names and labels (``model_name``, ``engine``) for what
this engine has, ``switchyard:`` names for the rest (``docs/metrics.md`` lists every one). The answer is always the
0.0.4 text format: prometheus-client's OpenMetrics answer escapes the colons in the names (``vllm_...``), and
vLLM's dashboards would then find nothing. ``_created`` series are off, as in vLLM.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from engine.step_record import HOST_PHASES, IDLE_REASONS, LAUNCH_PARTS, StepRecord
from engine.telemetry import THROTTLE_REASONS

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
FINISH_REASONS = ("stop", "length", "abort", "error")
WAITING_REASONS = ("capacity", "deferred")  # vLLM's; every waiting request here waits for capacity
ENERGY_WINDOW_S = 10.0  # joules per output token over this window
# per-GPU gauges: sample key → (metric name, help, scale)
GPU_GAUGES = {
    "power_w": ("switchyard:gpu_power_watts", "Power drawn by the rank's GPU (NVML, a 1 s average).", 1.0),
    "power_limit_w": ("switchyard:gpu_power_limit_watts", "The GPU's enforced power limit.", 1.0),
    "sm_clock_mhz": ("switchyard:gpu_sm_clock_hertz", "SM clock.", 1e6),
    "kernel_active_pct": ("switchyard:gpu_kernel_active_ratio",
                          "Share of time any kernel ran (NVML utilization.gpu; 1 for a memory-bound GPU).", 0.01),
    "sm_active_pct": ("switchyard:gpu_sm_active_ratio", "Share of SMs busy (GPM).", 0.01),
    "tensor_active_pct": ("switchyard:gpu_tensor_active_ratio", "Share of time SMs ran tensor ops (GPM).", 0.01),
    "dram_active_pct": ("switchyard:gpu_dram_active_ratio", "DRAM bandwidth used over its peak (GPM).", 0.01),
}


class MetricsExporter:
    """The metrics of one serving process. ``draft_positions``: speculative positions per draft (the speculation's
    ``draft_rows``; 0: speculation off, no ``vllm:spec_decode_*`` metrics); ``drafted_per_step``: draft tokens per
    request per speculative step (the tree's nodes, root excluded)."""

    def __init__(self, model_name: str, *, draft_positions: int = 0, drafted_per_step: int = 0):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}
        self.drafted_per_step = drafted_per_step
        reg = self.registry
        base = list(self.labels)

        def one(cls, name: str, doc: str, **kw):
            return cls(name, doc, base, registry=reg, **kw).labels(**self.labels)

        def by(cls, name: str, doc: str, extra: list[str], **kw):
            return cls(name, doc, base + extra, registry=reg, **kw)

        self.running = one(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        waiting = by(Gauge, "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason: "
                     "'capacity' = waiting for KV blocks or a running slot; 'deferred' = never here.", ["reason"])
        self.waiting_by = {r: waiting.labels(**self.labels, reason=r) for r in WAITING_REASONS}
        self.kv_usage = one(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = one(Counter, "vllm:prefix_cache_queries",
                           "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = one(Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_cached = one(Counter, "vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        self.preemptions = one(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt = one(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation = one(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        success = by(Counter, "vllm:request_success", "Count of successfully processed requests.",
                     ["finished_reason"])
        self.success = {r: success.labels(**self.labels, finished_reason=r) for r in FINISH_REASONS}
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        buckets=TTFT_BUCKETS)
        self.itl = one(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                       buckets=ITL_BUCKETS)
        self.e2e = one(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                       buckets=REQUEST_LATENCY_BUCKETS)
        self.queue = one(Histogram, "vllm:request_queue_time_seconds",
                         "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.spec = None
        if draft_positions:
            per_pos = by(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                         "Accepted tokens per draft position.", ["position"])
            self.spec = {"drafts": one(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                         "draft_tokens": one(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                         "accepted": one(Counter, "vllm:spec_decode_num_accepted_tokens",
                                         "Number of accepted tokens."),
                         "per_pos": [per_pos.labels(**self.labels, position=str(p)) for p in range(draft_positions)]}

        self.idle = by(Counter, "switchyard:idle_seconds", "Seconds the GPUs could have done more, by why not "
                       "(docs/metrics.md): no_work, blocked_kv, admission_limit, host_bound, draining.", ["reason"])
        self.idle_by = {r: self.idle.labels(**self.labels, reason=r) for r in IDLE_REASONS}
        self.steps = by(Counter, "switchyard:steps", "Engine steps by kind.", ["kind"])
        self.host = by(Histogram, "switchyard:step_host_seconds", "Rank 0's host seconds per step (the Engine.step "
                       "calls the step was finished by).", ["kind"], buckets=STEP_BUCKETS)
        self.device = by(Histogram, "switchyard:step_device_seconds", "Rank 0's device span per step (CUDA events "
                         "around its launch; absent off CUDA).", ["kind"], buckets=STEP_BUCKETS)
        phases = by(Counter, "switchyard:step_host_phase_seconds", "Rank 0's host seconds by phase of Engine.step "
                    "(draft and target split launch).", ["phase"])
        self.phases = {p: phases.labels(**self.labels, phase=p) for p in HOST_PHASES + LAUNCH_PARTS}
        self.replays = by(Counter, "switchyard:cuda_graph_replays", "Steps that replayed a CUDA graph, by kind and "
                          "rank.", ["kind", "rank"])
        self.eager = by(Counter, "switchyard:eager_steps", "Steps that ran eagerly, by kind, reason and rank.",
                        ["kind", "reason", "rank"])
        self.comm_bytes = by(Counter, "switchyard:comm_bytes", "Bytes rank 0 contributed to collectives, by group "
                             "and op.", ["group", "op"])
        self.comm_calls = by(Counter, "switchyard:comm_calls", "Collectives rank 0 entered, by group and op.",
                             ["group", "op"])
        self.kv_blocks = by(Gauge, "switchyard:kv_blocks", "KV blocks per attention-DP rank: used (referenced), "
                            "cached (in the prefix index), free (empty or evictable).", ["dp_rank", "state"])
        self.tau = one(Histogram, "switchyard:acceptance_length", "Committed tokens per speculative request per "
                       "step (tau, bonus included).", buckets=tuple(range(1, 17)))
        self._gpu: dict | None = None  # created with the first GPU sample: absent off CUDA
        self._cpu: dict | None = None  # created with the first CPU sample
        self._energy: dict[int, float] = {}  # rank → last energy reading (mJ)
        self._window: deque[tuple[float, float, int]] = deque()  # (t, joules, tokens) per record

    # ---- the subscriber -------------------------------------------------------------------------------------
    def observe(self, r: StepRecord) -> None:
        """Updates every metric from one record (the engine's thread)."""
        for reason, seconds in r.idle_s.items():
            if seconds:
                self.idle_by[reason].inc(seconds)
        self._scheduler(r)
        self._requests(r)
        joules = self._telemetry(r)
        self._energy_per_token(r.t_end, joules, r.tokens.generated)
        for (group, op), (calls, nbytes) in r.comm.items():
            self.comm_calls.labels(**self.labels, group=group, op=op).inc(calls)
            self.comm_bytes.labels(**self.labels, group=group, op=op).inc(nbytes)
        if r.kind is None:
            return
        kind = str(r.kind)
        self.steps.labels(**self.labels, kind=kind).inc()
        self.host.labels(**self.labels, kind=kind).observe(sum(r.host_ms[p] for p in HOST_PHASES) / 1e3)
        for phase, ms in r.host_ms.items():
            if ms:
                self.phases[phase].inc(ms / 1e3)
        if r.device_ms is not None:
            self.device.labels(**self.labels, kind=kind).observe(r.device_ms / 1e3)
        for rank, coverage in enumerate(r.graphs):
            for k, (replayed, reason) in coverage.items():
                if replayed:
                    self.replays.labels(**self.labels, kind=str(k), rank=str(rank)).inc()
                else:
                    self.eager.labels(**self.labels, kind=str(k), reason=reason, rank=str(rank)).inc()
        self._spec(r)

    def _scheduler(self, r: StepRecord) -> None:
        t = r.tokens
        running, waiting = sum(k.running for k in r.kv), sum(k.waiting for k in r.kv)
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_by["capacity"].set(waiting)
        self.waiting_by["deferred"].set(0)
        self.kv_usage.set(sum(k.blocks_used for k in r.kv) / max(sum(k.blocks_total for k in r.kv), 1))
        for dp, k in enumerate(r.kv):
            for state, n in (("used", k.blocks_used), ("cached", k.blocks_cached), ("free", k.blocks_free)):
                self.kv_blocks.labels(**self.labels, dp_rank=str(dp), state=state).set(n)
        if t.prompt_queried:
            self.queries.inc(t.prompt_queried)
        if t.prompt_cached:
            self.hits.inc(t.prompt_cached)
        if r.preemptions:
            self.preemptions.inc(r.preemptions)
        if t.generated:
            self.generation.inc(t.generated)

    def _requests(self, r: StepRecord) -> None:
        q = r.requests
        if q.first_prompt_tokens:
            self.prompt.inc(q.first_prompt_tokens)
        if q.first_cached_tokens:
            self.prompt_cached.inc(q.first_cached_tokens)
        for s in q.ttft_s:
            self.ttft.observe(s)
        for s in q.itl_s:
            self.itl.observe(s)
        for end in q.ended:
            self.success.get(end.finish_reason, self.success["error"]).inc()
            self.e2e.observe(end.e2e_s)
            self.queue.observe(end.queue_s)

    def _spec(self, r: StepRecord) -> None:
        if self.spec is None or not r.accepted:
            return
        s = self.spec
        s["drafts"].inc(len(r.accepted))
        s["draft_tokens"].inc(len(r.accepted) * self.drafted_per_step)
        s["accepted"].inc(sum(r.accepted))
        for p, counter in enumerate(s["per_pos"]):
            n = sum(a > p for a in r.accepted)
            if not n:
                break
            counter.inc(n)
        for n in r.accepted:
            self.tau.observe(n + 1)

    # ---- telemetry ------------------------------------------------------------------------------------------
    def _telemetry(self, r: StepRecord) -> float:
        """Updates the per-rank gauges from the samples the record carries; returns the joules the GPUs drew since
        their previous samples."""
        joules = 0.0
        for rank, sample in r.telemetry.items():
            if "gpus" in sample:
                joules += self._gpu_sample(str(rank), rank, sample["gpus"][0] if sample["gpus"] else {})
            elif "cpu_total_pct" in sample:
                self._cpu_sample(str(rank), sample)
        return joules

    def _gpu_sample(self, label: str, rank: int, g: dict) -> float:
        if self._gpu is None:
            reg, names = self.registry, ["model_name", "engine", "rank"]
            self._gpu = {key: Gauge(name, doc, names, registry=reg) for key, (name, doc, _) in GPU_GAUGES.items()}
            self._gpu["energy"] = Counter("switchyard:gpu_energy_joules", "Energy the rank's GPU drew while serving "
                                          "(NVML's counter).", names, registry=reg)
            self._gpu["throttle"] = Gauge("switchyard:gpu_throttle_reason", "1 while the GPU's clocks are held back "
                                          "for this reason (NVML clock event reasons).", names + ["reason"],
                                          registry=reg)
            self._gpu["per_token"] = Gauge("switchyard:energy_per_output_token_joules", "Joules all GPUs drew per "
                                           f"generated token over the last {ENERGY_WINDOW_S:g} s (NaN: no tokens).",
                                           ["model_name", "engine"], registry=reg)
        for key, (_, _, scale) in GPU_GAUGES.items():
            if key in g:
                self._gpu[key].labels(**self.labels, rank=label).set(g[key] * scale)
        if "throttle_reasons" in g:
            for reason in THROTTLE_REASONS:
                self._gpu["throttle"].labels(**self.labels, rank=label, reason=reason).set(
                    reason in g["throttle_reasons"])
        joules = 0.0
        if "energy_mj" in g:
            prev = self._energy.get(rank)
            if prev is not None and g["energy_mj"] >= prev:  # (a driver reload restarts NVML's counter)
                joules = (g["energy_mj"] - prev) / 1000
            self._gpu["energy"].labels(**self.labels, rank=label).inc(joules)  # from 0 at the first sample
            self._energy[rank] = g["energy_mj"]
        return joules

    def _cpu_sample(self, label: str, sample: dict) -> None:
        if self._cpu is None:
            reg = self.registry
            self._cpu = {"rank": Gauge("switchyard:cpu_utilisation_ratio", "CPU time of the rank's process over wall "
                                       "time (above 1 with several busy threads); exported where there is no GPU.",
                                       ["model_name", "engine", "rank"], registry=reg),
                         "host": Gauge("switchyard:host_cpu_utilisation_ratio", "Busy share of the host's CPUs "
                                       "(/proc/stat), as rank 0's host sees it.", ["model_name", "engine"],
                                       registry=reg).labels(**self.labels)}
        self._cpu["rank"].labels(**self.labels, rank=label).set(sample.get("process_cpu_pct", 0.0) / 100)
        if label == "0":
            self._cpu["host"].set(sample["cpu_total_pct"] / 100)

    def _energy_per_token(self, now: float, joules: float, tokens: int) -> None:
        if self._gpu is None:
            return
        self._window.append((now, joules, tokens))
        while self._window and self._window[0][0] < now - ENERGY_WINDOW_S:
            self._window.popleft()
        total_j, total_tokens = sum(w[1] for w in self._window), sum(w[2] for w in self._window)
        self._gpu["per_token"].labels(**self.labels).set(total_j / total_tokens if total_tokens else math.nan)

    def text(self) -> bytes:
        """The 0.0.4 text exposition (the names keep their colons)."""
        return generate_latest(self.registry)


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


def exporter_for(engine, model_name: str) -> MetricsExporter:
    """The exporter of ``engine`` (``engine.engine.Engine``), its spec-decode metrics shaped by the speculation."""
    facts = engine.speculation.facts if engine.speculation is not None else None
    return MetricsExporter(model_name, draft_positions=facts.draft_rows if facts else 0,
                           drafted_per_step=facts.tree_size - 1 if facts else 0)

