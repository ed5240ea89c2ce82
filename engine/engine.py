"""The engine on rank 0 and the worker loop on the other ranks.

Rank 0 holds the scheduler. Each step it broadcasts the plan (a small picklable object) to every
rank over the gloo control group, runs its own share, and gathers the sampled tokens from the rank that
holds each DP group's logits. Every rank enters every step, so all MoE collectives are matched; a rank
that dies makes the collectives fail (gloo/NCCL timeout) instead of hanging forever.

With ``engine.overlap=on`` (plain decoding) a step's results are read back and gathered one step late: every
rank launches step n+1 first — its decodes take step n's tokens on the device (``SeqWork.prev_row``) — then
reads back step n; rank 0 schedules step n+1 before it has step n's tokens. :data:`DRAIN` closes the pipeline
when there is nothing new to launch. Why and what it costs: ``docs/gpu_path.md`` ("Host per step").
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from engine.capture import GraphCoverage, eager_reason
from engine.cuda_graphs import StepShape
from engine.grammar import GrammarBackend
from engine.runner import Launched, ModelRunner
from engine.sampler import SamplingParams
from engine.scheduler import RequestError, Scheduler, SchedulerConfig
from engine.speculation import Speculation
from engine.step import RequestOutput, StepKind, StepPlan, StepResult
from engine.stop_strings import Detokenize
from model.kernel_select import launch_kernels
from model.transformer import CausalLM
from parallelism.comm import Comm, ParallelGroups

log = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
HEARTBEAT = "heartbeat"  # idle liveness round trip: no forward, no data collectives
DRAIN = "drain"  # overlap: nothing new to launch; read back and gather the step in flight


@dataclass(frozen=True)
class WarmUpShape:
    """Broadcast by :meth:`Engine.warm_up`: every rank runs (captures) static shape ``(batch, tree_size)`` once."""

    batch: int
    tree_size: int


STATIC_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # captured shapes (capped at engine.max_num_seqs)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_kinds: dict[StepKind, int] = field(default_factory=dict)  # a speculative step counts as VERIFY
    spec_request_steps: int = 0  # (request, target forward) pairs that verified a tree
    spec_tokens: int = 0  # tokens those committed, bonus included
    warmup_s: float = 0.0  # Engine.warm_up: every static shape run (captured on CUDA) before serving
    # per static shape: kind, batch, tree_size, seconds, graph, skipped, reason (the prefill: tokens, not tree_size)
    warmup_shapes: list[dict] = field(default_factory=list)
    # rank 0's host seconds per phase of Engine.step: schedule, launch (broadcast + queue the step; off CUDA it
    # computes there), readback (wait for the step's tokens + gather them), update (scheduler, outputs)
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("schedule", "launch", "readback",
                                                                            "update"), 0.0))

    @property
    def acceptance_length(self) -> float:
        """τ: committed tokens per target forward per request (bonus included); 0 without speculation."""
        return self.spec_tokens / self.spec_request_steps if self.spec_request_steps else 0.0


class Engine:
    """Rank-0 API: ``add_request``, ``abort``, ``step``; drives the other ranks."""

    def __init__(self, model: CausalLM, cfg: SchedulerConfig, seed: int = 0, speculation: Speculation | None = None,
                 tokenizer: Detokenize | None = None, grammar: GrammarBackend | None = None):
        """``speculation``: speculative decoding, built by spec_decode (``spec_decode.speculation``); None: off.
        ``tokenizer``: the checkpoint's (``model.tokenizer.load_tokenizer``), for stop strings; None: refused.
        ``grammar``: structured output over the checkpoint's tokenizer (``engine.grammar``); None: refused."""
        cfg = cfg.for_model(model.cfg.max_position_embeddings)
        self.model, self.groups = model, model.groups
        self.plane = control_plane(model.groups)
        self.speculation = speculation
        self.grammar = grammar
        self.runner = make_runner(model, cfg, speculation, grammar)
        self.scheduler = Scheduler(cfg, model.groups.layout.attn_dp, model.cfg.vocab_size, model.cfg.eos_token_ids,
                                   spec_reserve_slots=speculation.facts.spec_reserve_slots if speculation else 0,
                                   tokenizer=tokenizer, namespace=cache_namespace(model, speculation),
                                   retain_after=retain_after_ids(tokenizer))
        self.stats = EngineStats()
        self.coverage = GraphCoverage()  # rank 0's steps, as each step's RunnerOutput reports them
        self._rng = random.Random(seed)
        self._in_flight: tuple[StepPlan, Launched] | None = None  # overlap: launched, not yet read back
        self._unaccounted_s = 0.0  # step() time not yet attributed to a finished step
        if cfg.overlap == "on" and not self.scheduler.overlap:
            log.info("engine.overlap=on: speculative steps drain (the next start depends on the accepted count)")

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, dp_rank: int | None = None,
                    retain_kv: bool = False) -> None:
        """``dp_rank``: the attention-DP rank to run on (None: the scheduler places it); ``retain_kv``: keep its blocks
        past plain LRU when it ends (``engine.kv_retention_s``)."""
        if params.constraint is not None:
            if self.grammar is None:
                raise RequestError(f"{params.constraint.field}: structured output needs the checkpoint's tokenizer "
                                   "(tokenizer.json or tiktoken.model), and this engine was started without one")
            self.grammar.compile(params.constraint)  # ConstraintError names it; cached (the server compiled it)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.scheduler.add(request_id, prompt, params, seed, dp_rank=dp_rank, retain_kv=retain_kv)

    def abort(self, request_id: str) -> RequestOutput:
        return self.scheduler.abort(request_id)

    def warm_up(self) -> float:
        """Runs every configured static shape once on every rank before the first request — captured as CUDA
        graphs on CUDA, eagerly elsewhere — so no request pays Triton JIT or capture. Each shape is a lock-step
        round (broadcast, run on all-padding batches in the scratch blocks, gather), logged with a progress bar
        and its seconds; the result goes to ``stats.warmup_s`` / ``warmup_shapes`` (not to coverage or step
        counts). Returns the total seconds."""
        if self.has_work():
            raise RuntimeError("warm_up runs before the first request")
        shapes = self.runner.static_shapes()
        if not shapes and self.model.device.type != "cuda":  # nothing to capture, no Triton JIT to pay
            log.info("warm-up: no static shapes to run (%s)", self.runner.eager_reason)
            return 0.0
        t_all = time.perf_counter()
        for i, (batch, tree_size) in enumerate(shapes):
            t0 = time.perf_counter()
            self.plane.broadcast_object(WarmUpShape(batch, tree_size))
            replayed, reason = self.runner.warm_up(batch, tree_size)
            self.plane.gather_objects(None)
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
        seed stream is untouched; its steps, stats and coverage are dropped; its blocks are released."""
        cfg, sched = self.scheduler.cfg, self.scheduler
        tokens = min(cfg.max_num_batched_tokens, cfg.max_model_len - 1,
                     cfg.num_blocks * cfg.block_size - sched.spec_reserve_slots - 1)
        t0, warm = time.perf_counter(), self.stats
        params = SamplingParams(temperature=0.0, max_tokens=1, seed=0)
        for dp in range(sched.dp_size):
            self.add_request(f"warm-up prefill {dp}", [0] * tokens, params, dp_rank=dp)
        while self.has_work():
            self.step()
        sched.kv.clear()  # its blocks are nobody's prefix
        self.stats, self.coverage = EngineStats(warmup_shapes=warm.warmup_shapes), GraphCoverage()
        self.runner.timing = dict.fromkeys(self.runner.timing, 0.0)
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
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if plan.num_tokens:
            self.plane.broadcast_object(plan)
            launched = plan, self.runner.launch_plan(plan)
        elif self._in_flight is not None:
            self.plane.broadcast_object(DRAIN)
        t2 = time.perf_counter()
        self._host("schedule", t1 - t0)
        self._host("launch", t2 - t1)
        done, self._in_flight = [self._in_flight], None
        if launched is not None and launched[0].overlap:
            self._in_flight = launched
        else:
            done.append(launched)
        finished = [(d[0], self._complete(*d)) for d in done if d is not None]
        # the call's wall time goes to the step it finished (the first overlapped call finishes none: carried)
        self._unaccounted_s += time.perf_counter() - t0
        for i, (plan_done, (outputs, merged)) in enumerate(finished):
            self._account(plan_done, self._unaccounted_s if i == 0 else 0.0, merged, {o.request_id for o in outputs})
        if finished:
            self._unaccounted_s = 0.0
        return [o for _, (outputs, _) in finished for o in outputs]

    def _host(self, phase: str, seconds: float) -> None:
        self.stats.host_s[phase] += seconds

    def _complete(self, plan: StepPlan, step: Launched) -> tuple[list[RequestOutput], dict[str, StepResult]]:
        """Reads back rank 0's share of ``plan``, gathers every DP group's results and applies them; returns the
        outputs and the merged results."""
        t1 = time.perf_counter()
        mine = self.runner.finish(step)
        merged: dict[str, StepResult] = {}
        for part in self.plane.gather_objects(mine.results) or [mine.results]:
            if part:
                merged.update(part)
        t2 = time.perf_counter()
        outputs = self.scheduler.update(plan, merged)
        self._host("readback", t2 - t1)
        self._host("update", time.perf_counter() - t2)
        for kind, (replayed, reason) in mine.coverage.items():  # rank 0's step, draft and commit
            self.coverage.record(kind, replayed, reason)
        return outputs, merged

    def _account(self, plan: StepPlan, dt: float, results: dict[str, StepResult], emitted: set[str]) -> None:
        """``emitted``: the requests the step gave tokens to (overlap: one that ended a step earlier got none)."""
        s = self.stats
        s.steps += 1
        items = [w for per_rank in plan.work for w in per_rank]
        prefill = sum(len(w.token_ids) for w in items if not w.decode)
        decode = sum(len(results[w.request_id].tokens) for w in items if w.decode and w.request_id in emitted)
        spec = [w for w in items if w.spec]
        s.spec_request_steps += len(spec)
        s.spec_tokens += sum(len(results[w.request_id].tokens) for w in spec)
        kind = plan.kind  # the runner's coverage records the same kind (engine.step.step_kind)
        s.step_kinds[kind] = s.step_kinds.get(kind, 0) + 1
        s.prefill_tokens += prefill
        s.decode_tokens += decode
        if kind in (StepKind.DECODE, StepKind.VERIFY):
            s.decode_s += dt
        else:
            s.prefill_s += dt

    def heartbeat(self) -> None:
        """A control-plane round trip with every rank while idle: keeps idle workers inside the
        process-group timeout and surfaces a dead rank without traffic. Runs no forward; not counted."""
        self.plane.broadcast_object(HEARTBEAT)
        self.plane.gather_objects(None)

    def shutdown(self) -> None:
        """Releases the other ranks (a step still in flight is read back and applied first)."""
        if self._in_flight is not None:
            self.plane.broadcast_object(DRAIN)
            in_flight, self._in_flight = self._in_flight, None
            outputs, merged = self._complete(*in_flight)
            self._account(in_flight[0], 0.0, merged, {o.request_id for o in outputs})
        self.plane.broadcast_object(SHUTDOWN)


def cache_namespace(model: CausalLM, speculation: Speculation | None) -> bytes:
    """What a prefix-cache hash is computed under, so KV made one way never serves another: the model (its parsed
    config), the drafter (its context K/V sits in the same blocks), the KV dtype, the numerics mode (batch-invariant
    or not, kernel backend) and the attention layout."""
    lay = model.groups.layout
    parts = (repr(model.cfg), repr(speculation.facts) if speculation is not None else "no drafter", str(model.dtype),
             f"batch_invariant={model.kernels.batch_invariant} backend={model.kernels.backend}",
             f"attn_tp={lay.attn_tp} attn_dp={lay.attn_dp}")
    return "|".join(parts).encode()


RETAIN_AFTER = ("<|tool_calls_section_end|>", "<|tool_call_end|>")  # Kimi K2's tool-call markers


def retain_after_ids(tokenizer) -> frozenset[int]:
    """Token ids that, ending an output, mark a turn waiting on a tool (its KV is retained): Kimi's tool-call
    markers where the tokenizer has them as single tokens."""
    if tokenizer is None:
        return frozenset()
    ids = [tokenizer.encode(marker) for marker in RETAIN_AFTER]
    return frozenset(i[0] for i in ids if len(i) == 1)


def control_plane(groups: ParallelGroups) -> Comm:
    """Where plans and results travel: the gloo control group over every rank. On GPUs the world group is NCCL,
    whose object collectives stage through the device and make the host wait for the step in flight."""
    return groups.control or groups.world


def make_runner(model: CausalLM, cfg: SchedulerConfig, speculation: Speculation | None = None,
                grammar: GrammarBackend | None = None) -> ModelRunner:
    """The rank's ModelRunner, speculating with ``speculation`` (None: off), constraining with ``grammar`` (None:
    structured output refused), and static decode/verify steps per
    ``cfg.static_steps``; ``cfg.batch_invariant`` switches the model to its batch-invariant kernels (off: to the set
    they were made from)."""
    cfg = cfg.for_model(model.cfg.max_position_embeddings)
    kernels = launch_kernels(model.kernels, cfg.batch_invariant)
    if kernels is not model.kernels:
        model.use_kernels(kernels)
    on_cuda = model.device.type == "cuda"
    static = cfg.static_steps == "on" or (cfg.static_steps == "auto" and on_cuda)
    sizes = tuple(b for b in STATIC_BATCH_SIZES if b <= cfg.max_num_seqs) if static else ()
    return ModelRunner(model, cfg.num_blocks, cfg.block_size, speculation, static_batch_sizes=sizes,
                       max_model_len=cfg.max_model_len,
                       eager_reason="" if sizes else eager_reason(model, cfg.static_steps),
                       overlap=cfg.overlap == "on" and speculation is None, expert_tally=cfg.expert_tally,
                       grammar=grammar)


def worker_loop(runner: ModelRunner) -> None:
    """Non-zero ranks: execute broadcast plans until shutdown — in rank 0's order (``Engine.step``): launch the
    new plan, then read back and gather the step in flight, then this plan's unless it overlaps."""
    groups = runner.model.groups
    plane, in_flight = control_plane(groups), None
    while True:
        plan = plane.broadcast_object(None)
        if plan == SHUTDOWN:
            return
        if plan == HEARTBEAT:
            plane.gather_objects(None)
            continue
        if isinstance(plan, WarmUpShape):
            runner.warm_up(plan.batch, plan.tree_size)
            plane.gather_objects(None)
            continue
        launched = None if plan == DRAIN else runner.launch_plan(plan)
        if in_flight is not None:
            plane.gather_objects(runner.finish(in_flight).results)
        in_flight = launched if launched is not None and plan.overlap else None
        if launched is not None and not plan.overlap:
            plane.gather_objects(runner.finish(launched).results)
