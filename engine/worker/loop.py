"""Every rank but 0: the loop that runs what rank 0 broadcasts, and the runner each rank builds."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.params import Constraint
from engine.profiling import ProfileControl, RankProfiler
from engine.sampling.grammar import GrammarBackend
from engine.step import RankReport
from engine.worker.capture import eager_reason
from engine.worker.runner import Launched, ModelRunner
from engine.worker.spec_contract import Speculation
from engine.worker.telemetry import TelemetrySampler
from model.kernel_select import launch_kernels
from model.transformer import CausalLM
from parallelism.comm import Comm, ParallelGroups

SHUTDOWN = "shutdown"
HEARTBEAT = "heartbeat"  # idle liveness round trip: no forward, no data collectives
DRAIN = "drain"  # overlap: nothing new to launch; read back and gather the step in flight


@dataclass(frozen=True)
class WarmUpShape:
    """Broadcast by :meth:`Engine.warm_up`: every rank runs (captures) static shape ``(batch, tree_size)`` once."""

    batch: int
    tree_size: int


@dataclass(frozen=True)
class Precompile:
    """Broadcast by :meth:`Engine.precompile`: every rank starts compiling ``constraint`` on its grammar thread."""

    constraint: Constraint


STATIC_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # captured shapes (capped at engine.max_num_seqs)


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


def worker_loop(runner: ModelRunner, telemetry: TelemetrySampler | None = None) -> None:
    """Non-zero ranks: execute broadcast plans until shutdown — in rank 0's order (``Engine.step``): launch the
    new plan, then read back and gather the step in flight, then this plan's unless it overlaps. Each gather sends
    a :class:`RankReport` with ``telemetry``'s newest sample."""
    groups = runner.model.groups
    plane, in_flight = control_plane(groups), None
    profiler = RankProfiler(groups.rank, runner.model.device)

    def report(step: Launched | None) -> RankReport:
        sample = telemetry.fresh() if telemetry is not None else None
        if step is None:
            return RankReport(None, {}, sample)
        out = runner.finish(step)
        return RankReport(out.results, out.coverage, sample)

    while True:
        plan = plane.broadcast_object(None)
        if plan == SHUTDOWN:
            return
        if plan == HEARTBEAT:
            plane.gather_objects(report(None))
            continue
        if isinstance(plan, WarmUpShape):
            runner.warm_up(plan.batch, plan.tree_size)
            plane.gather_objects(None)
            continue
        if isinstance(plan, ProfileControl):
            plane.gather_objects(profiler.apply(plan))
            continue
        if isinstance(plan, Precompile):
            runner.precompile(plan.constraint)
            continue
        launched = None if plan == DRAIN else runner.launch_plan(plan)
        if in_flight is not None:
            plane.gather_objects(report(in_flight))
        in_flight = launched if launched is not None and plan.overlap else None
        if launched is not None and not plan.overlap:
            plane.gather_objects(report(launched))
