"""Every rank but 0: the loop that runs what rank 0 broadcasts, and the runner each rank builds."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.profiling import RankProfiler
from engine.sampling.grammar import GrammarBackend
from engine.worker.capture import eager_reason
from engine.worker.control import ControlPlane, RankState
from engine.worker.kv_budget import cache_namespace
from engine.worker.kv_store import StoreSettings
from engine.worker.runner import ModelRunner
from engine.worker.spec_contract import Speculation
from engine.worker.telemetry import TelemetrySampler
from model.kernel_select import launch_kernels
from model.transformer import CausalLM
from parallelism.comm import Comm, ParallelGroups

STATIC_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # captured shapes (capped at engine.max_num_seqs)


def control_plane(groups: ParallelGroups) -> Comm:
    """Where plans and results travel: the gloo control group over every rank. On GPUs the world group is NCCL,
    whose object collectives stage through the device and make the host wait for the step in flight."""
    return groups.control or groups.world


def make_runner(model: CausalLM, cfg: EngineConfig, speculation: Speculation | None = None,
                grammar: GrammarBackend | None = None) -> ModelRunner:
    """The rank's ModelRunner, speculating with ``speculation`` (None: off), constraining with ``grammar`` (None:
    structured output refused), and static decode/verify steps per ``cfg.runner.static_steps``;
    ``cfg.runner.batch_invariant`` switches the model to its batch-invariant kernels (off: to the set they were made
    from)."""
    cfg = cfg.for_model(model.cfg.max_position_embeddings)
    kernels = launch_kernels(model.kernels, cfg.runner.batch_invariant)
    if kernels is not model.kernels:
        model.use_kernels(kernels)
    on_cuda = model.device.type == "cuda"
    static = cfg.runner.static_steps == "on" or (cfg.runner.static_steps == "auto" and on_cuda)
    sizes = tuple(b for b in STATIC_BATCH_SIZES if b <= cfg.scheduler.max_num_seqs) if static else ()
    return ModelRunner(model, cfg.cache.num_blocks, cfg.cache.block_size, speculation, static_batch_sizes=sizes,
                       max_model_len=cfg.scheduler.max_model_len,
                       eager_reason="" if sizes else eager_reason(model, cfg.runner.static_steps),
                       overlap=cfg.runner.overlap == "on" and speculation is None, expert_tally=cfg.runner.expert_tally,
                       expert_load=cfg.runner.expert_load or cfg.balancer.eplb_enabled, grammar=grammar,
                       host_kv_cache_gb=cfg.cache.host_kv_cache_gb,
                       kv_store=store_settings(model, cfg, speculation))


def store_settings(model: CausalLM, cfg: EngineConfig, speculation: Speculation | None) -> StoreSettings | None:
    """The shared KV store's settings for this rank (``engine.kv_store``; None: no store): keys under the cache
    namespace, as this rank's place in its attention-TP group stores its share."""
    c = cfg.cache
    if c.kv_store == "none":
        return None
    tp = model.groups.attn_tp
    return StoreSettings(master=c.kv_store_master, metadata=c.kv_store_metadata, segment_gb=c.kv_store_gb,
                         timeout_s=c.kv_store_timeout_s, namespace=cache_namespace(model, speculation),
                         tp_rank=tp.rank, tp_size=tp.size)


def worker_loop(runner: ModelRunner, telemetry: TelemetrySampler | None = None) -> None:
    """Every rank but 0: runs what rank 0 sends (``engine/worker/control.py``) until it says :class:`Shutdown`; each
    gather carries ``telemetry``'s newest sample."""
    groups = runner.model.groups
    rank, plane = RankState(runner, telemetry, RankProfiler(groups.rank, runner.model.device)), \
        ControlPlane(control_plane(groups))
    while plane.serve(rank):
        pass
    runner.loads.close()
