"""The engine on rank 0 (the other ranks run ``engine/worker/loop.py``).

Rank 0 holds the scheduler. Each step it broadcasts the plan (a small picklable object) to every
rank over the gloo control group, runs its own share, and gathers the sampled tokens from the rank that
holds each DP group's logits. Every rank enters every step, so all MoE collectives are matched; a rank
that dies makes the collectives fail (gloo/NCCL timeout) instead of hanging forever.

With ``engine.overlap=on`` (plain decoding) a step's results are read back and gathered one step late: every
rank launches step n+1 first — its decodes take step n's tokens on the device (``SeqWork.prev_row``) — then
reads back step n; rank 0 schedules step n+1 before it has step n's tokens. A ``Drain`` message closes the pipeline
when there is nothing new to launch. Why and what it costs: ``docs/gpu_path.md`` ("Host per step").

Every finished step (and idle heartbeat) becomes one :class:`engine.core.step_record.StepRecord`, built on rank 0 from
every rank's :class:`~engine.step.RankReport` (results, coverage, telemetry sample) and handed to
:attr:`Engine.stats` and the subscribers (:meth:`Engine.subscribe`). Every message to the ranks is a typed
:class:`~engine.worker.control.RankMessage` sent through one :class:`~engine.worker.control.ControlPlane`;
:class:`~engine.profiling.ProfileControl` messages start and stop ``torch.profiler`` on every rank between steps.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.balancer import ExpertBalancer
from engine.config import EngineConfig, RequestError
from engine.core.kv_manager import KvEvent
from engine.core.recorder import DeviceSpan, EngineStats, StepRecorder
from engine.core.scheduler import Scheduler
from engine.core.spec_policy import AlwaysSpeculate, MeasuredSpeculation
from engine.core.step_record import StepRecord
from engine.core.turns import Turn, thought_marker_ids
from engine.kv_transfers import KVTransfers, PeerLease
from engine.messages import FlushResult
from engine.params import Constraint, SamplingParams
from engine.profiling import ProfileDriver, ProfilePlan, RankProfiler
from engine.sampling.grammar import GrammarBackend
from engine.step import RankReport, RequestOutput, StepKind, StepPlan, StepResult, sample_id
from engine.stop_strings import Detokenize, StopChecks
from engine.worker.control import (
    ControlPlane,
    Drain,
    Heartbeat,
    Precompile,
    Profile,
    RankState,
    ReadExpertLoad,
    Shutdown,
    Step,
    WarmUpShape,
)
from engine.worker.cuda_graphs import StepShape
from engine.worker.kv_budget import cache_namespace, kv_shape
from engine.worker.kv_loads import HostKV, KVSource
from engine.worker.loop import control_plane, make_runner
from engine.worker.runner import Launched
from engine.worker.spec_contract import Speculation
from engine.worker.telemetry import TelemetrySampler
from model.transformer import CausalLM

log = logging.getLogger(__name__)

@dataclass
class _InFlight:
    """A launched step not yet read back: its plan, the runner's handle and rank 0's device span (CUDA)."""

    plan: StepPlan
    step: Launched
    span: DeviceSpan | None


class Engine:
    """Rank-0 API: ``add_request``, ``abort``, ``step``; drives the other ranks."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, seed: int = 0, speculation: Speculation | None = None,
                 tokenizer: Detokenize | None = None, grammar: GrammarBackend | None = None,
                 telemetry: TelemetrySampler | None = None):
        """``speculation``: speculative decoding, built by spec_decode (``spec_decode.speculation``); None: off.
        ``tokenizer``: the checkpoint's (``model.tokenizer.load_tokenizer``), for stop strings; None: refused.
        ``grammar``: structured output over the checkpoint's tokenizer (``engine.grammar``); None: refused.
        ``telemetry``: this rank's sampler (``engine.worker.telemetry.rank_sampler``), read at every gather; None:
        none."""
        cfg = cfg.for_model(model.cfg.max_position_embeddings)
        self.model, self.groups = model, model.groups
        self.control = ControlPlane(control_plane(model.groups))
        self.speculation = speculation
        self.grammar = grammar
        self.runner = make_runner(model, cfg, speculation, grammar)
        self.spec_policy = MeasuredSpeculation() if speculation and speculation.facts.adaptive else AlwaysSpeculate()
        self.scheduler = Scheduler(cfg, model.groups.layout.attn_dp, model.cfg.vocab_size, model.cfg.eos_token_ids,
                                   spec_reserve_slots=speculation.facts.spec_reserve_slots if speculation else 0,
                                   namespace=cache_namespace(model, speculation),
                                   retain_after=retain_after_ids(tokenizer),
                                   host_slots=self.runner.loads.host.slots.shape[0] if self.runner.loads.host else 0,
                                   store_lookup=self.runner.loads.store.held if self.runner.loads.store else None,
                                   spec_policy=self.spec_policy)
        self.stops = StopChecks(tokenizer)  # stop strings: matched here, between the readback and the core's update
        self.thought_markers = thought_marker_ids(tokenizer)  # empty turns are counted after the close
        self.stats = EngineStats()
        self.recorder = StepRecorder(self.scheduler.stats, self.groups.counter)
        self.rank = RankState(self.runner, telemetry, RankProfiler(model.groups.rank, model.device))  # rank 0's share
        self.transfers = KVTransfers(self.control, self.rank, self.scheduler, kv_shape(model, speculation))
        self.profiling = ProfileDriver(lambda control: self.control.send(Profile(control), self.rank))
        self.balancer = ExpertBalancer(self.control, self.rank, cfg.balancer) if cfg.balancer.eplb_enabled else None
        self.draining = False  # set by the server on SIGTERM: counts as an idle reason (docs/metrics.md)
        self.last_record: StepRecord | None = None
        self._subscribers: list[Callable[[StepRecord], None]] = []
        self._rng = random.Random(seed)
        self._in_flight: _InFlight | None = None  # overlap: launched, not yet read back
        if cfg.runner.overlap == "on" and not self.scheduler.overlap:
            log.info("engine.overlap=on: speculative steps drain (the next start depends on the accepted count)")

    def subscribe(self, fn: Callable[[StepRecord], None]) -> None:
        """Calls ``fn(record)`` on the engine's thread after every step and idle heartbeat (after :attr:`stats`). An
        exception there is logged once and the record goes on to the other subscribers."""
        self._subscribers.append(fn)

    def _publish(self, record: StepRecord) -> None:
        if self.balancer is not None:
            record = replace(record, eplb=self.balancer.figures())
        self.last_record = record
        self.stats.observe(record)
        self.spec_policy.observe(record)
        for fn in list(self._subscribers):
            try:
                fn(record)
            except Exception:  # noqa: BLE001 - a subscriber's bug must not stop serving
                log.exception("step-record subscriber %r failed; it gets no more records", fn)
                self._subscribers.remove(fn)

    def precompile(self, constraint: Constraint) -> None:
        """A request under ``constraint`` is on its way (the server compiles it off the engine thread before admitting
        it, and calls this when it was not compiled here yet): every other rank starts compiling it now on its grammar
        thread, so that none compiles it on its step path when the request arrives in a plan. Nothing to do on one
        rank."""
        if self.control.size > 1 and self.grammar is not None:
            self.control.send(Precompile(constraint))

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, dp_rank: int | None = None,
                    retain_kv: bool = False, arrival: float | None = None, kv: KVSource | None = None,
                    lease: PeerLease | None = None, kv_missing: bool = False) -> None:
        """``dp_rank``: the attention-DP rank to run on (None: the scheduler places it); ``retain_kv``: keep its blocks
        past plain LRU when it ends (``engine.kv_retention_s``); ``arrival``: when it arrived (``time.monotonic``;
        None: now), where its time to first token and queue time start; ``kv``: where the KV of its leading prompt
        tokens is (``kv.num_tokens`` of them, made by an engine on the same weights and attention-TP split): it is
        loaded into the blocks admission reserves, off the step thread, and the request waits for it without holding
        up the others (a hand-off from an engine of another numerics mode or attention-DP size is indexed apart from
        this engine's own KV: ``KVTransfers.origin``); ``lease``: when it finishes, keep its prompt's KV for a
        decode worker to read (its last output's ``kv_transfer_params`` says where); ``kv_missing``: a decode worker
        got it without a hand-off, so the prompt tokens it computes count as recomputed."""
        if kv is not None:
            self.transfers.check(kv)
        if params.constraint is not None:
            if self.grammar is None:
                raise RequestError(f"{params.constraint.field}: structured output needs the checkpoint's tokenizer "
                                   "(tokenizer.json or tiktoken.model), and this engine was started without one")
            self.grammar.compile(params.constraint)  # ConstraintError names it; cached (the server compiled it)
        if params.stop and self.stops.tokenizer is None:
            raise RequestError(f"stop {list(params.stop)[:3]}: stop strings need the checkpoint's tokenizer "
                               "(tokenizer.json or tiktoken.model), and this engine was started without one")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.scheduler.add(request_id, prompt, params, seed, dp_rank=dp_rank, retain_kv=retain_kv,
                           kv_tokens=kv.num_tokens if kv is not None else 0,
                           lease_s=lease.seconds if lease is not None else 0.0,
                           kv_origin=self.transfers.origin(kv) if kv is not None else "")
        if kv is not None:
            self.transfers.sources[request_id] = kv
        if lease is not None:
            self.transfers.leases[request_id] = lease
        if kv_missing:
            self.transfers.missing.add(request_id)
        keys = [request_id] if params.n == 1 else [sample_id(request_id, i) for i in range(params.n)]
        self.stops.add(keys, prompt, params)
        turn = Turn.of(prompt, self.thought_markers, frozenset(self.model.cfg.eos_token_ids + params.stop_token_ids)) \
            if params.n == 1 else None
        self.recorder.arrived(request_id, arrival if arrival is not None else time.monotonic(), turn)

    def abort_all(self, request_id: str) -> list[RequestOutput]:
        """Ends ``request_id`` now: one finished output per sample still running (n > 1). Each goes to the stats
        record (``StepRecorder.aborted``), which ends the request once, at the first (the abort in /metrics)."""
        outs = self.scheduler.abort_all(request_id) or [self.scheduler.abort(request_id)]  # unknown id: RequestError
        self.transfers.sources.pop(request_id, None)
        self.transfers.leases.pop(request_id, None)
        self.transfers.missing.discard(request_id)
        self.stops.ended(outs)
        now = time.monotonic()
        for out in outs:
            self.recorder.aborted(out, now, self.scheduler.has_work())
        return outs

    def warm_up(self) -> float:
        """Runs every configured static shape once on every rank before the first request — captured as CUDA
        graphs on CUDA, eagerly elsewhere — so no request pays Triton JIT or capture. Each shape is a lock-step
        round (broadcast, run on all-padding batches in the scratch blocks, gather), logged with a progress bar
        and its seconds; the result goes to ``stats.warmup_s`` / ``warmup_shapes`` (no step record). Returns the
        total seconds."""
        if self.has_work():
            raise RuntimeError("warm_up runs before the first request")
        shapes = self.runner.static_shapes()
        if not shapes and self.model.device.type != "cuda":  # nothing to capture, no Triton JIT to pay
            log.info("warm-up: no static shapes to run (%s)", self.runner.eager_reason)
            return 0.0
        t_all = time.perf_counter()
        for i, (batch, tree_size) in enumerate(shapes):
            t0 = time.perf_counter()
            replayed, reason = self.control.send(WarmUpShape(batch, tree_size), self.rank)[0]
            dt = time.perf_counter() - t0
            kind, skipped = StepShape(batch, tree_size).kind, (batch, tree_size) in self.runner.skipped
            self.stats.warmup_shapes.append({"kind": kind, "batch": batch, "tree_size": tree_size, "seconds": dt,
                                             "graph": replayed, "skipped": skipped, "reason": reason})
            done = (i + 1) * 20 // len(shapes)
            what = "captured" if replayed else f"skipped ({reason})" if skipped else f"eager ({reason})"
            (log.warning if skipped else log.info)("warm-up |%s%s| %d/%d %s batch %d x tree size %d: %s in %.2f s",
                                                   "#" * done, "." * (20 - done), i + 1, len(shapes), kind, batch,
                                                   tree_size, what, dt)
        self._warm_prefill()
        self.stats.warmup_s = time.perf_counter() - t_all
        log.info("warm-up: %d static shapes and a prefill in %.2f s; KV blocks in use %d", len(shapes),
                 self.stats.warmup_s, self.scheduler.blocks_in_use())
        return self.stats.warmup_s

    def _warm_prefill(self) -> None:
        """One greedy prompt per attention-DP rank, as long as one step feeds, through the ordinary step path: the
        dynamic prefill's kernels (Triton JIT on CUDA) compile before the first request. Seeded, so the engine's
        seed stream is untouched; its records and stats are dropped; its blocks are released."""
        cfg, sched = self.scheduler.cfg, self.scheduler
        tokens = min(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_model_len - 1,
                     cfg.cache.num_blocks * cfg.cache.block_size - sched.spec_reserve_slots - 1)
        t0, warm = time.perf_counter(), self.stats
        params = SamplingParams(temperature=0.0, max_tokens=1, seed=0)
        for dp in range(sched.dp_size):
            self.add_request(f"warm-up prefill {dp}", [0] * tokens, params, dp_rank=dp)
        subscribers, self._subscribers = self._subscribers, []
        writes, sched.kv.store_writes = sched.kv.store_writes, None  # its blocks are not for the shared store
        try:
            while self.has_work():
                self.step()
        finally:
            self._subscribers, sched.kv.store_writes = subscribers, writes
        sched.kv.clear()  # its blocks are nobody's prefix
        if self.runner.expert_load is not None:  # nor is its routing anybody's load
            self.control.send(ReadExpertLoad(reset=True), self.rank)
        self.stats, self.last_record = EngineStats(warmup_shapes=warm.warmup_shapes), None
        self.recorder = StepRecorder(sched.stats, self.groups.counter)
        dt = time.perf_counter() - t0
        self.stats.warmup_shapes.append({"kind": StepKind.PREFILL, "batch": sched.dp_size, "tokens": tokens,
                                         "seconds": dt, "graph": False, "skipped": False,
                                         "reason": "dynamic shapes: not captured"})
        log.info("warm-up prefill: %d tokens on each of %d attention-DP ranks in %.2f s", tokens, sched.dp_size, dt)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, then reads back and applies the step that is done: this one, or with
        ``engine.overlap=on`` the one the previous call launched — so the host schedules and stages step n+1
        while the device runs step n, and each call returns step n's outputs (the first call returns none)."""
        t0 = time.perf_counter()
        self.recorder.begin(time.monotonic())
        self.profiling.before_step(self.stats.steps)
        self.transfers.finish_loads()
        refused = [replace(out, error=why) for rid, why in self.transfers.take_refused() for out in self.abort_all(rid)]
        if self.balancer is not None and self._in_flight is None:
            self.balancer.before_step(self.stats.steps)
        plan = self.scheduler.schedule()
        if self.balancer is not None:  # overlap: a step the balancer needs a boundary after is read back at once
            plan = replace(plan, expert_versions=self.balancer.versions,
                           overlap=plan.overlap and not self.balancer.due(self.stats.steps + 1))
        self.transfers.start_stores()
        self.transfers.start_loads()
        t1 = time.perf_counter()
        self.recorder.scheduled(plan, time.monotonic(), self.scheduler.blocked)
        launched = None
        if plan.num_tokens:
            self.control.send(Step(plan))  # rank 0 launches and reads back its share below
            span = DeviceSpan.open(self.model.device)
            step = self.runner.launch_plan(plan)
            if span is not None:
                span.stop()
            launched = _InFlight(plan, step, span)
            self.recorder.host("draft", step.draft_s)
            self.recorder.host("target", step.target_s)
        elif self._in_flight is not None:
            self.control.send(Drain())
        else:
            self.transfers.idle()
        t2 = time.perf_counter()
        self.recorder.host("schedule", t1 - t0)
        self.recorder.host("launch", t2 - t1)
        done, self._in_flight = [self._in_flight], None
        if launched is not None and launched.plan.overlap:
            self._in_flight = launched
        else:
            done.append(launched)
        finished = [(d, *self._complete(d)) for d in done if d is not None]
        for d, *parts in finished:  # the calls' time goes to the first (overlap: one carries to the next)
            self._publish(self.recorder.step(d.plan, *parts, d.span.ms() if d.span else None, self.draining))
        self.transfers.start_stores()  # what this step committed leaves now, even if no step follows
        self.profiling.after_step(self.stats.steps)
        return refused + self.transfers.hand_off([o for *_, outputs in finished for o in outputs])

    def _complete(self, d: _InFlight) -> tuple[list[RankReport], dict[str, StepResult], list[RequestOutput]]:
        """Reads back rank 0's share of ``d``, gathers every rank's report and applies the results; returns the
        reports (rank order), the results merged from them and the outputs."""
        t1 = time.perf_counter()
        reports = self.control.gather(self.rank.report(d.step))
        merged: dict[str, StepResult] = {}
        for report in reports:
            if report.results:
                merged.update(report.results)
        t2 = time.perf_counter()
        outputs = self.scheduler.update(d.plan, merged, self.stops.scan(merged))
        self.stops.ended(outputs)
        self.recorder.host("readback", t2 - t1)
        self.recorder.host("update", time.perf_counter() - t2)
        return reports, merged, outputs

    def read_prefix_kv(self, tokens: list[int], dp_rank: int = 0) -> HostKV:
        """The KV of the leading full blocks of ``tokens`` that attention-DP rank ``dp_rank``'s prefix cache holds,
        in host memory (:meth:`engine.kv_transfers.KVTransfers.read_prefix`): a source for :meth:`add_request`."""
        return self.transfers.read_prefix(tokens, dp_rank)

    def heartbeat(self) -> None:
        """A control-plane round trip with every rank while idle: keeps idle workers inside the process-group
        timeout, surfaces a dead rank without traffic and brings every rank's newest telemetry sample. Runs no
        forward; its record (``kind`` None) counts only idle time."""
        started = time.monotonic()
        self.scheduler.leases.expire()
        reports = self.control.send(Heartbeat(), self.rank)
        self._publish(self.recorder.heartbeat(reports, started, self.draining))

    def flush_cache(self) -> FlushResult:
        """Empties the prefix cache when no request is in the engine (``FlushCache``)."""
        s = self.scheduler.stats()
        return FlushResult(flushed=not self.has_work() and self.scheduler.kv.clear(), busy=s.running + s.waiting,
                           leased_blocks=self.scheduler.leases.num_blocks)

    def kv_events(self, on: bool) -> None:
        """Keep the prefix index's changes for :meth:`kv_events_since` (the server's ``SubscribeKvEvents``)."""
        self.scheduler.kv.recording = on

    def kv_events_since(self) -> list[KvEvent]:
        """The prefix index's changes since the last call."""
        return self.scheduler.kv.drain_events()

    def reset_counters(self) -> None:
        """The comm counters count from now (the server starts serving; warm-up's traffic is not its own)."""
        self.groups.counter.reset()

    # ---- profiling (engine/profiling.py) ------------------------------------------------------------------
    def start_profile(self, plan: ProfilePlan) -> None:
        """``torch.profiler`` on every rank for ``plan``'s steps (:meth:`ProfileDriver.start`)."""
        self.profiling.start(plan, self.stats.steps)

    def stop_profile(self) -> list[str]:
        """Writes every rank's trace; returns the files (:meth:`ProfileDriver.stop`)."""
        return self.profiling.stop()

    def shutdown(self) -> None:
        """Releases the other ranks (a step still in flight is read back and applied first; a profile running is
        written)."""
        if self._in_flight is not None:
            self.control.send(Drain())
            d, self._in_flight = self._in_flight, None
            self._publish(self.recorder.step(d.plan, *self._complete(d), d.span.ms() if d.span else None,
                                             self.draining))
        self.profiling.close()
        self.control.send(Shutdown())
        self.runner.loads.close()


RETAIN_AFTER = ("<|tool_calls_section_end|>", "<|tool_call_end|>")  # Kimi K2's tool-call markers


def retain_after_ids(tokenizer) -> frozenset[int]:
    """Token ids that, ending an output, mark a turn waiting on a tool (its KV is retained): Kimi's tool-call
    markers where the tokenizer has them as single tokens."""
    if tokenizer is None:
        return frozenset()
    ids = [tokenizer.encode(marker) for marker in RETAIN_AFTER]
    return frozenset(i[0] for i in ids if len(i) == 1)


