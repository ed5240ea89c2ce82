"""How many KV blocks a rank gets: on CUDA from the device's memory (``engine.gpu_memory_utilization``, vLLM's
name and rule), elsewhere ``engine.num_blocks``; the count and the maximum concurrency are logged at start."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.worker.expert_moves import slot_tensors, staging_bytes
from engine.worker.kv_cache import KVCacheSpec, KVSpec
from engine.worker.spec_contract import Speculation
from model.moe import MoE
from model.transformer import CausalLM

log = logging.getLogger("engine.kv")


def blocks_for_memory(free_bytes: int, total_bytes: int, bytes_per_block: int, utilization: float) -> int:
    """KV blocks that fit when the engine may use ``utilization`` of the device's ``total_bytes``: what is already
    taken (``total - free``: weights, the CUDA context, other processes) comes off that share first, and the rest is
    cut into blocks. 0 when nothing is left. Pure: tested on CPU."""
    if not 0 < utilization <= 1:
        raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = utilization * total_bytes - (total_bytes - free_bytes)
    return max(int(budget // bytes_per_block), 0)


def cache_spec(model: CausalLM, speculation: Speculation | None = None) -> KVCacheSpec:
    """The layer groups of this rank's KV cache: the target's, and the drafter context's with speculation."""
    return KVCacheSpec.of(KVSpec.for_model(model), speculation.facts.context_kv if speculation is not None else None)


def bytes_per_block(model: CausalLM, kv_block_size: int, speculation: Speculation | None = None) -> int:
    """This rank's KV bytes for one block of ``kv_block_size`` tokens over every layer group (:func:`cache_spec`)."""
    return cache_spec(model, speculation).bytes_per_token() * kv_block_size


def max_concurrency(num_blocks: int, cfg: EngineConfig) -> float:
    """Requests of ``max_model_len`` tokens the blocks hold at once (per attention-DP rank), as vLLM logs it."""
    return num_blocks * cfg.cache.block_size / cfg.scheduler.max_model_len


def size_kv_cache(model: CausalLM, cfg: EngineConfig, speculation: Speculation | None = None) -> EngineConfig:
    """``cfg`` with ``num_blocks`` sized from free device memory on CUDA (every rank measures, all take the
    smallest count); unchanged elsewhere or with ``cfg.cache.gpu_memory_utilization=None``. Call on every rank after the
    weights are loaded. Logs blocks, bytes and maximum concurrency on rank 0. ``max_model_len`` unset becomes the
    model's context length (:meth:`EngineConfig.for_model`)."""
    cfg = cfg.for_model(model.cfg.max_position_embeddings)
    per_block = bytes_per_block(model, cfg.cache.block_size, speculation)
    how, utilization = "engine.num_blocks", cfg.cache.gpu_memory_utilization
    if model.device.type == "cuda" and utilization is not None:
        torch.cuda.synchronize(model.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(model.device)
        if cfg.balancer.eplb_enabled:  # an expert move's staging buffers, allocated later, are counted now
            free -= staging_bytes(model)
        mine = blocks_for_memory(free, total, per_block, utilization)
        n = min(model.groups.world.all_gather_objects(mine))
        if n < 1:
            raise RuntimeError(f"engine.gpu_memory_utilization={utilization}: no memory left for one KV block "
                               f"({per_block} bytes) after the weights ({(total - free) / 2**30:.1f} of "
                               f"{total / 2**30:.1f} GiB in use); raise it or use more ranks")
        cfg = cfg.replace(num_blocks=n)
        how = f"engine.gpu_memory_utilization={utilization} (free {free / 2**30:.2f} of {total / 2**30:.2f} GiB)"
    if model.groups.coords.rank == 0:
        log.info("KV cache: %d blocks of %d tokens per rank, %.1f MiB (%d bytes/block) from %s; maximum concurrency "
                 "for %d tokens per request: %.2fx per attention-DP rank", cfg.cache.num_blocks, cfg.cache.block_size,
                 cfg.cache.num_blocks * per_block / 2**20, per_block, how, cfg.scheduler.max_model_len,
                 max_concurrency(cfg.cache.num_blocks, cfg))
        if model.groups.layout.expert_slots is not None or cfg.balancer.eplb_enabled:
            log.info("expert slots: %s; a move stages up to %.1f MiB%s", expert_slot_memory(model),
                     staging_bytes(model) / 2**20, " (kept free of KV on CUDA)" if cfg.balancer.eplb_enabled else "")
    return cfg


def expert_slot_memory(model: CausalLM) -> str:
    """What the routed experts' slots cost on this rank, the redundant ones included (a log line's words)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return "no MoE layers"
    placement = layers[0].dispatcher.placement
    held = sum(t.numel() * t.element_size() for m in layers for t in slot_tensors(m.experts))
    spare = placement.num_slots - placement.num_experts
    return (f"{placement.slots_per_rank} per rank per MoE layer ({placement.num_experts} experts + {spare} redundant "
            f"over {placement.moe_ep} EP ranks), {held / 2**20:.1f} MiB of expert weights per rank")


def kv_shape(model: CausalLM, speculation: Speculation | None) -> bytes:
    """What a block's bytes hold, whoever computed them and however attention is split: the model (its parsed
    config), the drafter (its context K/V sits in the same blocks) and the KV dtype. Two engines whose ``kv_shape``
    (and block size, and — unless every byte is replicated over attention-TP ranks — attention-TP size) agree can
    copy KV to each other (the prefill/decode hand-off, ``KVTransfers.fingerprint``), whatever their attention-DP
    size or numerics mode."""
    parts = (repr(model.cfg), repr(speculation.facts) if speculation is not None else "no drafter", str(model.dtype))
    return "|".join(parts).encode()


def cache_namespace(model: CausalLM, speculation: Speculation | None) -> bytes:
    """What a prefix-cache hash is computed under, so KV made one way never serves another: :func:`kv_shape`, the
    numerics mode (batch-invariant or not, kernel backend) and the attention layout."""
    lay = model.groups.layout
    return kv_shape(model, speculation) + (f"|batch_invariant={model.kernels.batch_invariant} "
                                           f"backend={model.kernels.backend}|attn_tp={lay.attn_tp} "
                                           f"attn_dp={lay.attn_dp}").encode()
