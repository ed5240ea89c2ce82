"""The engine on rank 0 and the worker loop on the other ranks.

Rank 0 holds the scheduler. Each step it broadcasts the plan (a small picklable object) to every
rank, runs its own share, and gathers the sampled tokens from the rank that holds each DP group's
logits. Every rank enters every step, so all MoE collectives are matched; a rank that dies makes the
collectives fail (gloo/NCCL timeout) instead of hanging forever.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from engine.capture import GraphCoverage, eager_reason
from engine.runner import ModelRunner
from engine.sampler import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculation import Speculation
from engine.step import RequestOutput, RunnerOutput, StepPlan, StepResult
from model.kernel_select import batch_invariant_kernels
from model.transformer import CausalLM

log = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
HEARTBEAT = "heartbeat"  # idle liveness round trip: no forward, no data collectives


STATIC_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # captured shapes (capped at engine.max_num_seqs)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_kinds: dict[str, int] = field(default_factory=dict)
    spec_request_steps: int = 0  # (request, target forward) pairs that verified a tree
    spec_tokens: int = 0  # tokens those committed, bonus included

    @property
    def acceptance_length(self) -> float:
        """τ: committed tokens per target forward per request (bonus included); 0 without speculation."""
        return self.spec_tokens / self.spec_request_steps if self.spec_request_steps else 0.0


class Engine:
    """Rank-0 API: ``add_request``, ``abort``, ``step``; drives the other ranks."""

    def __init__(self, model: CausalLM, cfg: SchedulerConfig, seed: int = 0, speculation: Speculation | None = None):
        """``speculation``: speculative decoding, built by spec_decode (``spec_decode.speculation``); None: off."""
        self.model, self.groups = model, model.groups
        self.speculation = speculation
        self.runner = make_runner(model, cfg, speculation)
        self.scheduler = Scheduler(cfg, model.groups.layout.attn_dp, model.cfg.vocab_size, model.cfg.eos_token_ids,
                                   spec_scratch=speculation.scratch_slots if speculation is not None else 0)
        self.stats = EngineStats()
        self.coverage = GraphCoverage()  # rank 0's steps, as each step's RunnerOutput reports them
        self._rng = random.Random(seed)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.scheduler.add(request_id, prompt, params, seed)

    def abort(self, request_id: str) -> RequestOutput:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.num_tokens == 0:
            return []
        t0 = time.perf_counter()
        mine, sampled = self._execute(plan)
        dt = time.perf_counter() - t0
        outputs = self.scheduler.update(plan, sampled)
        self._account(plan, dt, sampled)
        for kind, (replayed, reason) in mine.coverage.items():  # rank 0's step, draft and commit
            self.coverage.record(kind, replayed, reason)
        return outputs

    def _execute(self, plan: StepPlan) -> tuple[RunnerOutput, dict[str, StepResult]]:
        """Rank 0's RunnerOutput and every DP group's results, merged."""
        world = self.groups.world
        world.broadcast_object(plan)
        mine = self.runner.execute(plan.work[self.groups.coords.attn_dp_rank], plan.work)
        merged: dict[str, StepResult] = {}
        for part in world.gather_objects(mine.results) or [mine.results]:
            if part:
                merged.update(part)
        return mine, merged

    def _account(self, plan: StepPlan, dt: float, results: dict[str, StepResult]) -> None:
        s = self.stats
        s.steps += 1
        items = [w for per_rank in plan.work for w in per_rank]
        prefill = sum(len(w.token_ids) for w in items if not w.decode)
        decode = sum(len(results[w.request_id].tokens) for w in items if w.decode)
        spec = [w for w in items if w.spec]
        s.spec_request_steps += len(spec)
        s.spec_tokens += sum(len(results[w.request_id].tokens) for w in spec)
        kind = plan.kind
        s.step_kinds[kind] = s.step_kinds.get(kind, 0) + 1
        s.prefill_tokens += prefill
        s.decode_tokens += decode
        if kind == "decode":
            s.decode_s += dt
        else:
            s.prefill_s += dt

    def heartbeat(self) -> None:
        """A control-plane round trip with every rank while idle: keeps idle workers inside the
        process-group timeout and surfaces a dead rank without traffic. Runs no forward; not counted."""
        self.groups.world.broadcast_object(HEARTBEAT)
        self.groups.world.gather_objects(None)

    def shutdown(self) -> None:
        self.groups.world.broadcast_object(SHUTDOWN)


def make_runner(model: CausalLM, cfg: SchedulerConfig, speculation: Speculation | None = None) -> ModelRunner:
    """The rank's ModelRunner, speculating with ``speculation`` (None: off), and static decode/verify steps per
    ``cfg.static_steps``; ``cfg.batch_invariant`` switches the model to its batch-invariant kernels."""
    if cfg.batch_invariant:
        model.use_kernels(batch_invariant_kernels(model.kernels))
    on_cuda = model.device.type == "cuda"
    static = cfg.static_steps == "on" or (cfg.static_steps == "auto" and on_cuda)
    sizes = tuple(b for b in STATIC_BATCH_SIZES if b <= cfg.max_num_seqs) if static else ()
    return ModelRunner(model, cfg.num_blocks, cfg.block_size, speculation, static_batch_sizes=sizes,
                       max_model_len=cfg.max_model_len,
                       eager_reason="" if sizes else eager_reason(model, cfg.static_steps))


def worker_loop(runner: ModelRunner) -> None:
    """Non-zero ranks: execute broadcast plans until shutdown."""
    groups = runner.model.groups
    while True:
        plan = groups.world.broadcast_object(None)
        if plan == SHUTDOWN:
            return
        if plan == HEARTBEAT:
            groups.world.gather_objects(None)
            continue
        mine = runner.execute(plan.work[groups.coords.attn_dp_rank], plan.work)
        groups.world.gather_objects(mine.results)
